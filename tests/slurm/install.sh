#!/usr/bin/env bash
# Install what tests/slurm/cluster.py runs, from the distribution's packages (Debian/Ubuntu, as root):
# slurmctld, slurmd and the client commands, slurmdbd with MariaDB (for sacct), and munge.
set -euo pipefail
packages=(slurm-wlm slurmdbd munge mariadb-server)
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null 2>&1; then
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${packages[@]}"
fi
