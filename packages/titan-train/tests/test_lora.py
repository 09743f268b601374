"""LoRA through the trainer, against Hugging Face's own code: a tiny Llama and Qwen3 saved by transformers
are imported, trained with adapters and exported; PEFT loads the adapter folder on the transformers base
and gives Titan's logits, and so does the merged export alone. Only the adapters change."""

import json
import logging
import shutil

import pytest
import torch
import torch.distributed.checkpoint
from peft import PeftModel
from transformers import AutoModelForCausalLM

from titan_models import llama3_args, to_hf_config
from titan_models.qwen3 import Qwen3Args, Qwen3StateDictAdapter
from titan_train.cli import run
from titan_train.commands.checkpoint_model import load_checkpoint_model
from titan_train.errors import ConfigError
from titan_train.plan import resolve
from titan_train.trainer import Trainer
from titan_train.wiring.data import BUNDLED_TOKENIZER
from titan_train.wiring.lora_export import PEFT_CONFIG, PEFT_FOLDER


def _qwen3_config() -> dict:
    args = Qwen3Args(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=2048,
        hidden_dim=96,
        head_dim=32,
        max_seq_len=64,
    )
    return {**Qwen3StateDictAdapter(args).hf_config(), "tie_word_embeddings": True}


FAMILIES = {
    "llama3": lambda: {**to_hf_config(llama3_args("debugmodel")), "num_hidden_layers": 2},
    "qwen3": _qwen3_config,
}


def _save_hf_model(folder, config: dict):
    """Random weights (norms included), saved by transformers with the bundled tokenizer's files."""
    config = {k: v for k, v in config.items() if k != "torch_dtype"}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_auto_config(config), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.05 * torch.randn(p.shape))
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_TOKENIZER / name, folder / name)
    return model


def _auto_config(config: dict):
    from transformers import AutoConfig

    model_type = config.pop("model_type")
    return AutoConfig.for_model(model_type, **config)


def _flags(folder, name, *more):
    return (
        "--model.name",
        name,
        "--model.flavor",
        "from_hf",
        "--checkpoint.enable",
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.initial_load_path",
        str(folder),
        "--model.hf_assets_path",
        str(folder),
        "--model.converters",
        "lora",
        *more,
    )


@pytest.mark.parametrize("family", list(FAMILIES))
def test_peft_loads_the_exported_adapter_with_titans_logits_and_only_adapters_train(
    family, tmp_path, small_config, one_rank
):
    folder = tmp_path / "hf"
    hf = _save_hf_model(folder, FAMILIES[family]())
    config = small_config(
        tmp_path / "run",
        *_flags(folder, family, "--lora.rank", "4", "--lora.alpha", "8", "--lora.dropout", "0.1"),
        "--lora.target_modules",
        "q_proj,v_proj,down_proj,w3",
        "--checkpoint.last_save_in_hf",
        "--checkpoint.interval",
        "2",
        "--training.steps",
        "3",
    )
    trainer = Trainer(resolve(config, 1, "cpu"), one_rank)
    model = trainer.model_parts[0]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n.split(".")[-3] for n in trainable} == {"wq", "wv", "w2", "w3"}
    trainer.train()

    # Only the adapters changed: every base tensor is bit-identical to the transformers model's.
    exported_base = trainer.checkpointer.hf_adapter.base.to_hf(
        {n: t for n, t in model.state_dict().items() if ".lora_" not in n}
    )
    expected = hf.state_dict()
    assert exported_base.keys() == {
        k for k in expected if k != "lm_head.weight" or not hf.config.tie_word_embeddings
    }
    for name, tensor in exported_base.items():
        assert torch.equal(tensor, expected[name]), name
    # Optimizer state exists for the adapter parameters only.
    optimizer = trainer.optimizers.optimizers[0]
    with_state = {id(p) for p in optimizer.state}
    assert with_state == {id(p) for n, p in model.named_parameters() if n in trainable}
    lora_b = [p for n, p in model.named_parameters() if ".lora_B." in n]
    assert all(p.abs().max() > 0 for p in lora_b)  # the adapters trained

    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(1))
    export = tmp_path / "run" / "checkpoint" / "step-3"
    with torch.no_grad():
        ours = model.eval()(tokens)
        base_logits = hf(tokens).logits
        assert (ours - base_logits).abs().max() > 1e-4  # the adapters change the function
        adapter = json.loads((export / PEFT_FOLDER / PEFT_CONFIG).read_text())
        assert (adapter["r"], adapter["lora_alpha"], sorted(adapter["target_modules"])) == (
            4,
            8.0,
            ["down_proj", "q_proj", "up_proj", "v_proj"],
        )
        assert adapter["base_model_name_or_path"] == str(folder.resolve())
        base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        peft_model = PeftModel.from_pretrained(base, export / PEFT_FOLDER).eval()
        assert (peft_model(tokens).logits - ours).abs().max() <= 1e-5
        merged = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
        assert (merged(tokens).logits - ours).abs().max() <= 1e-5
        # What `titan-train generate/eval` load: the DCP checkpoint with its adapters, or the merged export.
        for weights in ("dcp", "hf"):
            loaded = load_checkpoint_model(config, export, device=torch.device("cpu"), weights=weights)
            assert (loaded.model(tokens) - ours).abs().max() <= 1e-5, weights

        # An adapter-only step folder (step-2) reads its base from the Hugging Face folder it names: the same
        # logits and greedy tokens as the whole step-3 model given step-2's adapters (read from its files).
        step2 = tmp_path / "run" / "checkpoint" / "step-2"
        from_adapters = load_checkpoint_model(config, step2, device=torch.device("cpu"), weights="dcp").model
        whole = load_checkpoint_model(config, export, device=torch.device("cpu"), weights="dcp").model
        adapters = {n: torch.empty_like(t) for n, t in whole.state_dict().items() if ".lora_" in n}
        torch.distributed.checkpoint.load(adapters, checkpoint_id=str(step2), no_dist=True)
        whole.load_state_dict(adapters, strict=False)
        got, expected = from_adapters(tokens), whole(tokens)
        assert (got - expected).abs().max() <= 1e-6
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
        assert (expected - ours).abs().max() > 1e-5  # step-2's adapters are not step-3's


BAD_INPUT = {
    "rank": (("--lora.rank", "0"), "config: lora.rank must be at least 1, got 0"),
    "alpha": (("--lora.alpha", "-1"), "config: lora.alpha must be above 0, got -1.0"),
    "dropout": (("--lora.dropout", "1"), "config: lora.dropout must be below 1, got 1.0"),
    "target": (
        ("--lora.target_modules", "q_proj,qkv_proj"),
        "config: lora.target_modules ['qkv_proj'] match no linear layer of llama3 debugmodel; its linear layers "
        "are output, gate_proj (w1), down_proj (w2), up_proj (w3), k_proj (wk), o_proj (wo), q_proj (wq), "
        "v_proj (wv); or use all-linear",
    ),
    "order": (
        ("--model.converters", "lora,quantize.linear.float8"),
        "config: model.converters ['lora', 'quantize.linear.float8'] puts lora before ['quantize.linear.float8']: "
        "the adapters must sit on the quantised layers; list lora last (model.converters = "
        "['quantize.linear.float8', 'lora'])",
    ),
    "qlora_kind": (
        ("--lora.quantize_base", "int4"),
        "config: lora.quantize_base = 'int4' is not one of '', 'nf4'",
    ),
    "qlora_float8": (
        ("--model.converters", "quantize.linear.float8,lora", "--lora.quantize_base", "nf4"),
        "config: lora.quantize_base = \"nf4\" with model.converters ['quantize.linear.float8']: a linear layer "
        "holds either an NF4 base or a float8/MXFP8 one; drop one of them",
    ),
    "qlora_without_lora": (
        ("--model.converters", "quantize.linear.float8", "--lora.quantize_base", "nf4"),
        'config: lora.quantize_base = "nf4" quantises the base under LoRA adapters, but model.converters '
        "['quantize.linear.float8'] has no lora; add it (model.converters = [..., \"lora\"])",
    ),
    "qlora_compile": (
        ("--lora.quantize_base", "nf4", "--compile.enable"),
        'config: lora.quantize_base = "nf4" with compile.enable: compiling NF4 matmuls is not tested; set '
        "compile.enable = false",
    ),
    "qlora_blocks": (
        ("--lora.quantize_base", "nf4", "--lora.nf4_scaler_block_size", "65536"),
        # lora.target_modules' default names Hugging Face modules (q_proj, v_proj): so does the message
        "config: qlora: q_proj in layers.0 (Titan's layers.0.attention.wq.weight) has 65536 values, not a multiple "
        "of 64 x lora.nf4_scaler_block_size (65536); choose a smaller nf4_scaler_block_size",
    ),
    "qlora_blocks_titan_names": (  # Titan's names where the user wrote those
        (
            "--lora.target_modules",
            "wv,wq",
            "--lora.quantize_base",
            "nf4",
            "--lora.nf4_scaler_block_size",
            "65536",
        ),
        "config: qlora: layers.0.attention.wq.weight has 65536 values, not a multiple of 64 x "
        "lora.nf4_scaler_block_size (65536); choose a smaller nf4_scaler_block_size",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_lora_settings_stop_at_start_in_one_line(case, tmp_path, caplog):
    flags, says = BAD_INPUT[case]
    argv = [
        "--job.dump_folder",
        str(tmp_path),
        "--training.seq_len",
        "32",
        "--model.converters",
        "lora",
        *flags,
    ]
    with caplog.at_level(logging.ERROR):
        assert run(argv) == 2
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert line == says


QLORA_SPLITS = {
    "tensor_parallel_degree": "tp",
    "context_parallel_degree": "cp",
    "pipeline_parallel_degree": "pp",
    "data_parallel_replicate_degree": "dp_replicate",
}


@pytest.mark.parametrize("split", list(QLORA_SPLITS))
def test_qlora_split_other_than_fsdp_stops_at_start_in_one_line(split, small_config, tmp_path):
    config = small_config(
        tmp_path, "--model.converters", "lora", "--lora.quantize_base", "nf4", f"--parallelism.{split}", "2"
    )
    with pytest.raises(ConfigError) as err:
        resolve(config, 2, "cpu")
    assert (
        'config: lora.quantize_base = "nf4" runs in one process or under FSDP 2 (dp_shard, or HSDP with '
        f"dp_replicate); this run also splits the model by {{'{QLORA_SPLITS[split]}': 2}}, which no test covers for "
        "an NF4 base"
    ) in str(err.value)
    assert "set those degrees to 1 and shard with dp_shard, or train LoRA without quantize_base" in str(
        err.value
    )


QLORA_SHARDED = (
    "--model.converters",
    "lora",
    "--lora.quantize_base",
    "nf4",
    "--parallelism.data_parallel_shard_degree",
)


def test_qlora_under_fsdp_needs_whole_nf4_groups_in_each_shard(small_config, tmp_path):
    """FSDP 2 is accepted; a shard that would cut a group of NF4 blocks (here 65536 values over 2 ranks) is not."""
    flags = QLORA_SHARDED  # then the dp_shard degree
    assert resolve(small_config(tmp_path, *flags, "2"), 2, "cpu").dims.dp_shard == 2
    with pytest.raises(ConfigError) as err:
        resolve(small_config(tmp_path, *flags, "2", "--lora.nf4_scaler_block_size", "1024"), 2, "cpu")
    assert str(err.value) == (
        "config: qlora: q_proj in layers.0 (Titan's layers.0.attention.wq.weight) [256, 256] cannot be split into 2 "
        "NF4 shards: its dim 0 must divide by 2 and each shard's values by 65536 (64 x lora.nf4_scaler_block_size); choose a smaller "
        "nf4_scaler_block_size or fewer dp_shard ranks"
    )


def test_qlora_with_a_torchao_too_old_stops_at_start_in_one_line(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr("titan_train.wiring.qlora.torchao_version", lambda: "0.16.0")
    argv = ["--job.dump_folder", str(tmp_path), "--training.seq_len", "32"]
    with caplog.at_level(logging.ERROR):
        assert run([*argv, "--model.converters", "lora", "--lora.quantize_base", "nf4"]) == 2
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert line == "config: qlora: torchao 0.16.0 is too old for NF4 (to_nf4); install torchao>=0.17"


def test_qlora_under_fsdp_on_a_torch_older_than_2_15_stops_at_start_in_one_line(
    small_config, tmp_path, monkeypatch
):
    """The NF4 re-sharding calls FSDP internals as torch 2.15 has them (2.11's take other arguments)."""
    monkeypatch.setattr("torch.__version__", "2.11.0")
    flags = QLORA_SHARDED  # then the dp_shard degree
    with pytest.raises(ConfigError) as err:
        resolve(small_config(tmp_path, *flags, "2"), 2, "cpu")
    assert str(err.value) == (
        "config: qlora: an NF4 base under FSDP needs torch >= 2.15 (this is torch 2.11.0; Titan re-shards the "
        "quantised weights through FSDP internals as 2.15 has them); upgrade torch, or train QLoRA on one process"
    )
    assert resolve(small_config(tmp_path, *flags, "1"), 1, "cpu").dims.dp_shard == 1  # one process still runs


def test_all_linear_leaves_out_the_linears_each_family_names():
    """all-linear adapts every linear but the ones the model names (`linears_not_adapted`): the output
    head, as PEFT's all-linear leaves out `lm_head`, and each MoE router's gate, on a Qwen3 MoE model."""
    from titan_models.moe import MoEArgs
    from titan_models.qwen3 import Qwen3Model
    from titan_parallel import LoRA, target_linears

    args = Qwen3Args(
        dim=32,
        n_layers=2,
        n_heads=2,
        n_kv_heads=2,
        head_dim=16,
        vocab_size=64,
        moe_args=MoEArgs(num_experts=4),
    )
    with torch.device("meta"):
        model = Qwen3Model(args)
    assert model.linears_not_adapted() == ("output", "gate")
    chosen = target_linears(model, LoRA(targets=("all-linear",)).targets)
    every = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert every - set(chosen) == {"output", "layers.0.moe.router.gate", "layers.1.moe.router.gate"}
