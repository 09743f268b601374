import torch
from torch import nn

from titan_models import LLAMA3_FLAVORS, ModelArgs, Transformer, count_parameters, flops_per_token, llama3_args


def _tiny(**overrides) -> ModelArgs:
    args = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=32, rope_theta=500000)
    return ModelArgs(**{**args, **overrides})


def _materialised(args: ModelArgs, seed: int = 0) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


def test_8b_flavor_counts_published_parameters_on_meta_device():
    with torch.device("meta"):
        model = Transformer(llama3_args("8B"))
    assert count_parameters(model) == 8_030_261_248


def test_debugmodel_shape_and_parameter_count():
    args = LLAMA3_FLAVORS["debugmodel"]
    assert (args.dim, args.n_layers, args.n_heads, args.vocab_size, args.rope_theta) == (256, 6, 16, 2048, 500000)
    with torch.device("meta"):
        assert count_parameters(Transformer(llama3_args("debugmodel"))) == 6_163_712


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


def test_parallel_blocks_name_every_layer():
    model = _materialised(_tiny(n_layers=3))
    blocks = model.parallel_blocks()
    assert list(blocks) == ["layers.0", "layers.1", "layers.2"]
    assert all(isinstance(b, nn.Module) for b in blocks.values())


def test_flops_per_token_is_6n_plus_attention():
    args = llama3_args("8B")
    with torch.device("meta"):
        model = Transformer(args)
    n = count_parameters(model)
    emb = n - count_parameters(model, exclude_embedding=True)
    expected = 6 * (n - emb) + 12 * 32 * 32 * 128 * 8192
    assert flops_per_token(args, n, emb, 8192) == expected
