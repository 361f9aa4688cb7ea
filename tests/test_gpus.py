import pytest

from cs336_systems.gpus import GPU_SPECS, resolve_gpu, slugify, spec_for_device_name


@pytest.mark.parametrize("device_name, slug", [
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA H200", "h200"),
    ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA A100 80GB PCIe", "a100"),
    ("NVIDIA B200", "b200"),
])
def test_device_names_map_to_their_spec(device_name, slug):
    assert spec_for_device_name(device_name).slug == slug


@pytest.mark.parametrize("device_name", ["NVIDIA L4", "NVIDIA GH200 480GB", "NVIDIA GH200 144G HBM3e",
                                         "NVIDIA H200 NVL", "NVIDIA H100 NVL", "NVIDIA GB200"])
def test_a_gpu_outside_the_table_gets_no_spec_even_where_its_name_holds_a_tabled_one(device_name):
    assert spec_for_device_name(device_name) is None


def test_unknown_gpu_gets_a_path_safe_slug():
    assert slugify("NVIDIA L4 (rev 2)") == "nvidia-l4-rev-2"


def test_table_has_the_required_parts_with_consistent_figures():
    assert {"a100", "h100", "h200", "b200"} <= set(GPU_SPECS)
    for spec in GPU_SPECS.values():
        assert spec.bf16_flops > spec.tf32_flops > spec.fp32_flops > 0
        assert spec.memory_bandwidth_bytes_per_s > 1e12 and spec.memory_bytes >= 40e9
        assert spec.peak_flops("fp16") == spec.bf16_flops
    assert GPU_SPECS["h200"].bf16_flops == GPU_SPECS["h100"].bf16_flops  # same chip, faster memory
    assert GPU_SPECS["h200"].memory_bandwidth_bytes_per_s > GPU_SPECS["h100"].memory_bandwidth_bytes_per_s


def _machine_with(monkeypatch, device_name):
    """Make torch see one CUDA device named `device_name`, or none."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: device_name is not None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: device_name)


def test_resolve_gpu_choices(monkeypatch):
    _machine_with(monkeypatch, "NVIDIA H100 80GB HBM3")
    assert resolve_gpu("none") == ("cpu", None)
    assert resolve_gpu("h100") == ("h100", GPU_SPECS["h100"])
    assert resolve_gpu("auto") == ("h100", GPU_SPECS["h100"])
    with pytest.raises(ValueError, match="unknown GPU 'v100'"):
        resolve_gpu("v100")
    with pytest.raises(ValueError, match="unknown precision"):
        GPU_SPECS["h100"].peak_flops("int8")


@pytest.mark.parametrize("present, named, message", [
    (None, "a100", "a100 is the NVIDIA A100-SXM4-80GB, but torch sees no CUDA GPU on this machine; pass none"),
    ("NVIDIA H100 80GB HBM3", "a100", "this machine's GPU is the NVIDIA H100 80GB HBM3; pass h100 or auto"),
    ("NVIDIA H100 PCIe", "h100", "this machine's GPU is the NVIDIA H100 PCIe; pass h100-pcie or auto"),
    ("NVIDIA L4", "h100", "this machine's GPU is the NVIDIA L4; pass auto"),
])
def test_naming_a_gpu_this_machine_does_not_have_is_refused(monkeypatch, present, named, message):
    _machine_with(monkeypatch, present)
    with pytest.raises(ValueError, match=message):
        resolve_gpu(named)
