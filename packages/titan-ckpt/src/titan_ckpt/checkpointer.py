"""Periodic, atomic, optionally asynchronous checkpoints of a training run on torch.distributed.checkpoint.

Layout (torchtitan's): the model's parameters are stored at the top level under their own names
and every other state under its name (`optimizer.*`, `dataloader.*`, ...), so full checkpoints,
model-only checkpoints and seed checkpoints share weight names and load into each other, and
checkpoints torchtitan wrote load here (a state it keeps in another format is named, not misread).

The last step's save is a full checkpoint, so a run started again with more steps continues. The
export that `last_save_model_only` asks for is written beside the full state in the same `step-N`,
published with it in one rename: Hugging Face files (`last_save_in_hf`) next to the DCP files, where
torchtitan's users and `from_pretrained` look for them, or a model-only DCP checkpoint in
`export_dtype` in `step-N/model_only`.

A run with a `FrozenBase` (a LoRA run's base) leaves those weights out of its periodic saves and
reads them from where they came from on resume (`titan_ckpt.frozen_base`).
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from titan_ckpt.async_save import (
    PendingSave,
    SaveTiming,
    build_stager,
    snapshot_objects,
    stager_for_next_save,
)
from titan_ckpt.collectives import barrier, decide_on_rank0, group_rank, raise_on_every_rank
from titan_ckpt.errors import CheckpointError
from titan_ckpt.frozen_base import FrozenBase, base_source, holds_frozen_base, write_record
from titan_ckpt.hf_export import write_hf_export
from titan_ckpt.hf_import import load_hf_weights
from titan_ckpt.hf_safetensors import HFStateDictAdapter
from titan_ckpt.integrity import find_problem, flatten_state_dict, read_metadata, saved_keys
from titan_ckpt.load_source import MODEL, LoadResult, choose_source
from titan_ckpt.policies import LastSavePolicy, LoadPolicy, SavePolicy
from titan_ckpt.step_folders import (
    MODEL_ONLY_DIR,
    folder_bytes,
    partial_folder,
    publish,
    purge_old,
    remove_partial_folders,
    step_folder,
)

logger = logging.getLogger(__name__)


def _describe(err: BaseException) -> str:
    """One line per failing rank instead of DCP's full tracebacks (they stay chained on the error)."""
    if isinstance(err, CheckpointException):
        return "; ".join(
            f"rank {rank}: {type(exc).__name__}: {exc}" for rank, (exc, _) in err.failures.items()
        )
    return f"{type(err).__name__}: {err}"


def _holds(saved: set[str], prefix: str) -> bool:
    """Whether the flattened keys `saved` hold `prefix` (a value, or a dict under it)."""
    return any(k == prefix or k.startswith(prefix + ".") for k in saved)


class Checkpointer:
    """Saves `states` into `folder/step-N` as `saving` says and restores a run at start as `loading` says.

    `states` maps names to DCP Statefuls; the entry named "model" is the model (see the module
    docstring). The policies (`titan_ckpt.policies`; their defaults where not given) check their own
    values; the Checkpointer checks them against the states. `hf_adapter` is needed only for Hugging
    Face loads and exports; `hf_unheld_effect` (see `titan_ckpt.hf_export.write_hf_export`) only for the
    export's warning about state the format cannot hold. A state may list `optional_keys`: keys of its state dict that a checkpoint
    may lack (its load_state_dict then gets the dict without them), and `older_keys`: {key: the name
    it had in older checkpoints}, read under the old name where a checkpoint holds only that. With
    `shared_folder`, other jobs write into `folder` too (torchft's replica groups): their `.partial`
    folders may be saves in flight, so `plan_load` leaves them alone. All ranks must construct the
    Checkpointer and call `load`, `maybe_save` and `close` together. Before each optimizer step, call
    `wait_for_staging`.
    """

    def __init__(
        self,
        folder: str | Path,
        states: Mapping[str, Stateful],
        *,
        saving: SavePolicy | None = None,
        loading: LoadPolicy | None = None,
        last_save: LastSavePolicy | None = None,
        hf_adapter: HFStateDictAdapter | None = None,
        hf_unheld_effect: Callable[[], tuple[int, int] | None] | None = None,
        frozen_base: FrozenBase | None = None,
        process_group: dist.ProcessGroup | None = None,
        shared_folder: bool = False,
    ):
        saving, loading, last_save = (
            saving or SavePolicy(),
            loading or LoadPolicy(),
            last_save or LastSavePolicy(),
        )
        for name, state in states.items():
            if not isinstance(state, Stateful):
                raise CheckpointError(
                    f"checkpoint: state '{name}' ({type(state).__name__}) needs state_dict() and load_state_dict()"
                )
        unknown = [name for name in loading.exclude_from_loading if name not in states]
        if unknown:
            raise CheckpointError(
                f"checkpoint: exclude_from_loading names {unknown}, which are not states; choose from {sorted(states)}"
            )
        if (last_save.model_only or bool(loading.initial_load_path)) and MODEL not in states:
            raise CheckpointError(
                f"checkpoint: model-only saves and initial loads need a state named '{MODEL}'"
            )
        if (last_save.in_hf or loading.initial_load_in_hf) and hf_adapter is None:
            raise CheckpointError(
                "checkpoint: last_save_in_hf / initial_load_in_hf need a Hugging Face weight mapping (hf_adapter) "
                "for this model; none was given"
            )
        self.folder = Path(folder)
        self.shared_folder = shared_folder
        self.states = dict(states)
        self.saving, self.loading, self.last_save = saving, loading, last_save
        self.hf_adapter, self.hf_unheld_effect = hf_adapter, hf_unheld_effect
        self.frozen_base = frozen_base
        self.timings: list[SaveTiming] = []
        # A gloo group of our own: async writes run collectives from a background thread, which must
        # not interleave with training's collectives, and DCP's async path needs a CPU backend.
        if process_group is None and dist.is_initialized():
            process_group = dist.new_group(backend="gloo")
        self._group = process_group
        self._stager = build_stager(saving.async_mode, warn=self._rank() == 0)
        self._pending: PendingSave | None = None

    def _rank(self) -> int:
        return group_rank(self._group)

    # -- loading ------------------------------------------------------------------------------------

    def step_folder(self, step: int) -> Path:
        return step_folder(self.folder, step)

    def export_folder(self, step: int) -> Path:
        """Where the last save's export of step N lies: `step-N` itself for Hugging Face files (beside
        the DCP files), else `step-N/model_only`."""
        folder = self.step_folder(step)
        return folder if self.last_save.in_hf else folder / MODEL_ONLY_DIR

    def plan_load(self) -> LoadResult:
        """Decide what `load` restores (the same decision on every rank), without loading or logging it.

        Interrupted saves are removed first (not in a shared folder). A caller may adapt to the decision (a state rebuilt to
        match the checkpoint, say) and add a note to it before passing it to `load`.
        """
        if self._rank() == 0 and not self.shared_folder:
            remove_partial_folders(self.folder)
        barrier(self._group)
        wanted = [name for name in self.states if name not in self.loading.exclude_from_loading]

        def decide() -> LoadResult:
            result = choose_source(
                self.folder,
                wanted,
                self._present_states,
                load_step=self.loading.load_step,
                initial=self.loading.initial,
            )
            if result.kind != "initial" and result.path is not None:
                base_source(result.path, self.frozen_base)  # refuses a base that cannot be found
            return result

        return decide_on_rank0(decide, self._group)

    def saved_keys(self, path: Path) -> set[str]:
        """The flattened keys a DCP checkpoint folder holds (`optimizer.state.<fqn>.exp_avg`, ...)."""
        return saved_keys(read_metadata(path))

    def load(self, plan: LoadResult | None = None) -> LoadResult:
        """Restore the run: its newest complete checkpoint, else `initial_load_path`, else nothing.

        `plan` is a decision from `plan_load` (made here when None). It is logged ("resuming from
        step-N", "no checkpoint; loading initial weights from X", "no checkpoint; fresh start").
        """
        result = self.plan_load() if plan is None else plan
        if self._rank() == 0:
            logger.info("checkpoint: %s", result.message)
        if result.kind == "fresh":
            return result
        if result.hf:
            self._load_hf(
                result.path, quantized=result.kind == "initial" and self.loading.initial_load_in_hf_quantized
            )
        else:
            if result.kind != "initial" and MODEL in result.states:
                self._load_frozen_base(result.path)
            self._load_dcp(result.path, result.states)
        return result

    def _load_frozen_base(self, step: Path) -> None:
        """Read the frozen base of a trainable-only checkpoint from its source (nothing for a checkpoint that
        holds the whole model, or for a base that is the run's own initialisation, already in place)."""
        source = base_source(step, self.frozen_base)
        if source is None or source.initial is None:
            return
        path = Path(source.initial.path)
        if self._rank() == 0:
            logger.info(
                "checkpoint: %s holds the trained weights only; reading the frozen base from %s", step, path
            )
        if source.initial.in_hf:
            self._load_hf(path, quantized=source.quantized)
        else:
            frozen = self.frozen_base.keys if self.frozen_base is not None else None
            self._load_dcp(path, (MODEL,), model_keys=frozen)

    def _present_states(self, path: Path) -> set[str]:
        keys = saved_keys(read_metadata(path))
        tops = {key.split(".", 1)[0] for key in keys}
        return {name for name in self.states if name != MODEL and name in tops}

    def _state_dicts(self, names: Iterable[str]) -> dict[str, Any]:
        """The current state of `names`, with the model's entries at the top level."""
        names = list(names)
        merged: dict[str, Any] = {}
        if MODEL in names:
            merged.update(self.states[MODEL].state_dict())
            clash = sorted({k.split(".", 1)[0] for k in merged} & (set(self.states) - {MODEL}))
            if clash:
                raise CheckpointError(
                    f"checkpoint: model parameter names start with state names {clash}; rename the states"
                )
        for name in names:
            if name != MODEL:
                merged[name] = self.states[name].state_dict()
        return merged

    def _drop_unsaved_optional_keys(self, state: dict[str, Any], names: list[str], saved: set[str]) -> None:
        for name in names:
            for key in getattr(self.states[name], "optional_keys", ()) if name != MODEL else ():
                if key in state[name] and not _holds(saved, f"{name}.{key}"):
                    del state[name][key]

    def _read_older_names(
        self, state: dict[str, Any], names: list[str], saved: set[str], path: Path
    ) -> list[tuple[str, str, str]]:
        """Point each key a checkpoint holds only under its older name at that name; return the renames."""
        renamed = []
        for name in names:
            older = getattr(self.states[name], "older_keys", {}) if name != MODEL else {}
            for key, old in older.items():
                if (
                    key in state[name]
                    and not _holds(saved, f"{name}.{key}")
                    and _holds(saved, f"{name}.{old}")
                ):
                    state[name][old] = state[name].pop(key)
                    renamed.append((name, key, old))
                    if self._rank() == 0:
                        logger.info(
                            "checkpoint: %s holds %s.%s, the older name of %s.%s; read as %s.%s",
                            path,
                            name,
                            old,
                            name,
                            key,
                            name,
                            key,
                        )
        return renamed

    def _load_dcp(self, path: Path, names: Iterable[str], model_keys: Iterable[str] | None = None) -> None:
        """Load `names` from the DCP checkpoint in `path`; of the model, only `model_keys` where given, and
        only what it holds where it is a trainable-only checkpoint."""
        names = list(names)
        state = self._state_dicts(names)
        if model_keys is not None:
            keep = set(model_keys)
            state = {k: v for k, v in state.items() if k in keep or (k in names and k != MODEL)}
        elif MODEL in names and not holds_frozen_base(path):
            saved = self.saved_keys(path)
            state = {k: v for k, v in state.items() if k in saved or (k in names and k != MODEL)}
        renamed: list[tuple[str, str, str]] = []
        try:
            metadata = read_metadata(path)
            self._drop_unsaved_optional_keys(state, names, saved_keys(metadata))
            renamed = self._read_older_names(state, names, saved_keys(metadata), path)
            others = [name for name in names if name != MODEL]
            problem = find_problem(path, metadata, flatten_state_dict(state), others)
        except CheckpointError as err:
            problem = str(err)
        raise_on_every_rank(problem, self._group)
        try:
            dcp.load(state, checkpoint_id=str(path), process_group=self._group)
        except (Exception, CheckpointException) as err:  # DCP gathers every rank's failure into one
            raise CheckpointError(f"checkpoint: cannot load {path}: {_describe(err)}") from err
        for name, key, old in renamed:
            state[name][key] = state[name].pop(old)
        self._apply(state, names)

    def _apply(self, state: dict[str, Any], names: list[str]) -> None:
        for name in names:
            if name != MODEL:
                self.states[name].load_state_dict(state.pop(name))
        if MODEL in names:
            self.states[MODEL].load_state_dict(state)

    def _load_hf(self, path: Path, *, quantized: bool = False) -> None:
        if self.hf_adapter is None:
            raise CheckpointError(
                f"checkpoint: {path} holds Hugging Face safetensors; loading it needs an hf_adapter"
            )
        target = self.states[MODEL].state_dict()
        try:
            load_hf_weights(path, self.hf_adapter, target, quantized=quantized)
            problem = None
        except CheckpointError as err:
            problem = str(err)
        raise_on_every_rank(problem, self._group)
        self.states[MODEL].load_state_dict(target)

    # -- saving -------------------------------------------------------------------------------------

    def maybe_save(self, step: int, *, last_step: bool = False) -> bool:
        """Save if `step` is due (every `interval`, step 1 with enable_first_step_checkpoint, the last step).

        The last step's save is a synchronous full checkpoint (what a longer run resumes from), with
        the export of last_save_model_only beside it (see the module docstring). Returns whether a
        save started. With `load_only` nothing is ever saved.
        """
        self._commit_if_done()
        if self.saving.load_only:
            return False
        if last_step:
            self._save_last(step)
            return True
        if step % self.saving.interval == 0 or (step == 1 and self.saving.enable_first_step_checkpoint):
            self.save(step)
            return True
        return False

    def save(
        self,
        step: int,
        *,
        model_only: bool = False,
        in_export_dtype: bool = False,
        wait: bool = False,
    ) -> None:
        """Write `step-N`: in the background per `async_mode`, or synchronously with `wait`.

        `model_only` writes the model alone (a seed checkpoint), in `export_dtype` when
        `in_export_dtype`; model-only saves are always synchronous.
        """
        self._finish_pending()
        started = time.perf_counter()
        partial, final = self._prepare(step)
        if model_only:
            cast = self._export if in_export_dtype else (lambda value: value)
            state = {k: cast(v) for k, v in self.states[MODEL].state_dict().items()}
        else:
            state = self._state_dicts(self.states)
            frozen = self.frozen_base
            if frozen is not None and frozen.trainable_only_saves:
                state = {k: v for k, v in state.items() if k not in frozen.keys}
                if self._rank() == 0:
                    write_record(
                        partial, frozen, self.loading.initial, self.loading.initial_load_in_hf_quantized
                    )
        if self._stager is None or wait or model_only:
            self._dcp_save(state, partial)
            elapsed = time.perf_counter() - started
            self._commit(step, partial, final, blocked_s=elapsed, total_s=elapsed)
            return
        self._stager = stager_for_next_save(self._stager, self.saving.async_mode)
        response = dcp.async_save(
            snapshot_objects(state) if self.saving.async_mode == "async_with_pinned_mem" else state,
            checkpoint_id=str(partial),
            process_group=self._group,
            async_stager=self._stager,
        )
        upload, staging = (
            (response, None)
            if isinstance(response, Future)
            else (response.upload_completion, response.staging_completion)
        )
        self._pending = PendingSave(
            step, partial, final, upload, staging, started, time.perf_counter() - started
        )
        upload.add_done_callback(self._pending.mark_finished)

    def _save_last(self, step: int) -> None:
        """The full state and, with last_save_model_only, its export, published together as `step-N`."""
        self._finish_pending()
        started = time.perf_counter()
        partial, final = self._prepare(step)
        self._dcp_save(self._state_dicts(self.states), partial)
        if self.last_save.in_hf:
            self._write_hf(partial)
        elif self.last_save.model_only:
            model = {k: self._export(v) for k, v in self.states[MODEL].state_dict().items()}
            self._dcp_save(model, partial / MODEL_ONLY_DIR)
        elapsed = time.perf_counter() - started
        self._commit(step, partial, final, blocked_s=elapsed, total_s=elapsed)

    def _dcp_save(self, state: dict[str, Any], path: Path) -> None:
        try:
            dcp.save(state, checkpoint_id=str(path), process_group=self._group)
        except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
            raise CheckpointError(f"checkpoint: saving {path} failed: {_describe(err)}") from err

    def _write_hf(self, folder: Path) -> None:
        """The model as Hugging Face sharded safetensors in `export_dtype`, with `config.json` (its
        `torch_dtype` the export dtype, `hf_config_keys` over the adapter's) and `hf_extra_files`, into `folder`."""
        if self.hf_adapter is None:
            raise CheckpointError("checkpoint: saving in Hugging Face format needs an hf_adapter")
        write_hf_export(
            folder,
            self.states[MODEL].state_dict(),
            self.hf_adapter,
            {
                **self.hf_adapter.hf_config(),
                **self.last_save.hf_config_keys,
                "torch_dtype": self.last_save.export_dtype,
            },
            dtype=self.last_save.dtype,
            lossy=self.last_save.hf_lossy,
            unheld_effect=self.hf_unheld_effect,
            max_shard_bytes=self.last_save.max_shard_bytes,
            extra_files=self.last_save.hf_extra_files,
            group=self._group,
        )

    def _export(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.detach().to(self.last_save.dtype)
        return value

    def _prepare(self, step: int) -> tuple[Path, Path]:
        partial, final = partial_folder(self.folder, step), self.step_folder(step)
        if self._rank() == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)  # debris of an earlier failed attempt at this step
        barrier(self._group)
        return partial, final

    def _commit(self, step: int, partial: Path, final: Path, *, blocked_s: float, total_s: float) -> None:
        """Publish a finished save. DCP finishes on rank 0 only after every rank has written, so rank 0
        alone can rename it."""
        written = None
        if self._rank() == 0:
            written = folder_bytes(partial)
            publish(partial, final)
            logger.info(
                "checkpoint: saved %s (%.1f MB) in %.2f s; training blocked %.2f s",
                final,
                written / 1e6,
                total_s,
                blocked_s,
            )
            purge_old(self.folder, self.saving.keep_latest_k)
        self.timings.append(SaveTiming(step, blocked_s, total_s, written))

    def wait_for_staging(self) -> None:
        """Block until a background save has copied the state. Call it before every optimizer step:
        the copy of `async_with_pinned_mem` reads the tensors while training goes on, and a step
        that changed them first would leak into the checkpoint."""
        if self._pending is not None:
            self._pending.wait_for_staging()

    def _commit_if_done(self) -> None:
        if self._pending is not None and self._pending.upload.done():
            self._finish_pending()

    def _finish_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        pending.wait_for_staging()  # counts its own wait
        start = time.perf_counter()
        try:
            pending.upload.result()
        except (Exception, CheckpointException) as err:
            raise CheckpointError(
                f"checkpoint: background save of {pending.partial} failed: {_describe(err)}"
            ) from err
        pending.blocked_s += time.perf_counter() - start
        # The write may finish while training is still blocked (a fast write, or a wait for it here).
        total = max((pending.finished or time.perf_counter()) - pending.started, pending.blocked_s)
        self._commit(pending.step, pending.partial, pending.final, blocked_s=pending.blocked_s, total_s=total)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        """`close` after a clean exit. After an error a save still in flight is left unpublished, as a
        kill would leave it: waiting for it could block on a rank that failed, and the next start
        removes its partial folder."""
        if exc_type is None:
            self.close()

    def close(self) -> None:
        """Finish and publish a save still in flight, and release staging memory."""
        try:
            self._finish_pending()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None
