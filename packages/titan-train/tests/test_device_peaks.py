import pytest
import torch

from titan_train.reporting.device_peaks import peak_flops, peak_flops_for_name


@pytest.mark.parametrize(
    "name,tflops",
    [
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H100 NVL", 835),
        ("NVIDIA H200", 989.4),
        ("NVIDIA A100-SXM4-80GB", 312),
        ("NVIDIA B200", 2250),
        ("NVIDIA GB200", 2500),
        ("AMD Instinct MI250X", 383),
        ("AMD Instinct MI300X", 1307.4),
    ],
)
def test_mfu_peaks_of_common_accelerators_by_device_name(name, tflops):
    assert peak_flops_for_name(name) == pytest.approx(tflops * 1e12)


def test_unknown_gpus_and_cpus_have_no_peak_so_no_mfu():
    assert peak_flops_for_name("NVIDIA GeForce GTX 1080") is None
    assert peak_flops(torch.device("cpu")) is None
