import pytest
import torch.distributed as dist


@pytest.fixture
def single_process_group(tmp_path_factory):
    """A real one-rank gloo group, as DCP and the checkpointer use collectives."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg') / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
