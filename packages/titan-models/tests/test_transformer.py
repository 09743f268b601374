"""The Llama transformer itself: forward, causality, init, tied embeddings, pipeline units."""

import pytest
import torch
from family_checks import materialised
from torch import nn

from titan_models import ModelArgs, ModelError, Transformer


def _tiny(**overrides) -> ModelArgs:
    args = dict(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=32, rope_theta=500000
    )
    return ModelArgs(**{**args, **overrides})


def _materialised(args, seed=0):
    return materialised(Transformer, args, seed)


def test_forward_gives_logits_per_position():
    model = _materialised(_tiny())
    tokens = torch.randint(0, 128, (3, 16))
    assert model(tokens).shape == (3, 16, 128)


def test_init_is_deterministic_under_a_seed_and_changes_with_it():
    a, b, c = _materialised(_tiny(), 1), _materialised(_tiny(), 1), _materialised(_tiny(), 2)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name


def test_output_projections_shrink_with_depth():
    model = _materialised(_tiny(n_layers=8, dim=256))
    first = model.layers["0"].attention.wo.weight.std().item()
    last = model.layers["7"].attention.wo.weight.std().item()
    assert abs(first - 0.02 / 2**0.5) < 0.002
    assert abs(last - 0.02 / 16**0.5) < 0.001


def test_model_is_causal():
    model = _materialised(_tiny())
    tokens = torch.randint(0, 128, (1, 16))
    changed = tokens.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 128
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_tied_embeddings_stay_one_parameter_from_meta_to_trained():
    model = _materialised(_tiny(tie_word_embeddings=True, dim=256))
    assert model.output.weight is model.tok_embeddings.weight
    assert {"tok_embeddings.weight", "output.weight"} <= set(model.state_dict())
    # Drawn once, by the output projection's rule (std dim^-0.5), not as a unit-variance embedding.
    assert abs(model.tok_embeddings.weight.std().item() - 256**-0.5) < 0.005
    loss = model(torch.randint(0, 128, (2, 8))).logsumexp(-1).mean()
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    assert torch.equal(model.output.weight, model.tok_embeddings.weight)


def test_parallel_blocks_name_every_layer():
    model = _materialised(_tiny(n_layers=3))
    blocks = model.parallel_blocks()
    assert list(blocks) == ["layers.0", "layers.1", "layers.2"]
    assert all(isinstance(b, nn.Module) for b in blocks.values())


def test_pipeline_stages_built_from_units_compose_to_the_whole_model():
    model = _materialised(_tiny(n_layers=4))
    units = model.pipeline_units()
    assert units == ["tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "output"]
    tokens = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        expected = model(tokens)
        h = tokens
        for kept in (units[:3], units[3:]):
            stage = _materialised(_tiny(n_layers=4))
            stage.load_state_dict(model.state_dict())
            for unit in units:
                if unit in kept:
                    continue
                if unit.startswith("layers."):
                    del stage.layers[unit.split(".")[1]]
                else:
                    setattr(stage, unit, None)
            h = stage(h)
    torch.testing.assert_close(h, expected, rtol=0, atol=0)


def test_input_longer_than_max_seq_len_is_refused_with_the_fix():
    model = _materialised(_tiny(max_seq_len=8))
    with pytest.raises(ModelError, match=r"16 positions is longer than max_seq_len \(8\)"):
        model(torch.zeros(1, 16, dtype=torch.long))
