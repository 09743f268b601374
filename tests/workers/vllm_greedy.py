"""Greedy completions of Hugging Face folders in vLLM, run by apps/vllm's environment (tests/test_hf_export_vllm.py).

`python vllm_greedy.py JOBS OUT`: JOBS is {"prompts": [[ids]], "max_new": n, "max_model_len": n, "folders":
{name: [folder, dtype]}}; one JSON line per folder is appended to OUT: {"name", "tokens"} or {"name", "error"}.
The engines run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0: no start-up per engine); an engine that fails
leaves vLLM's process state broken, so the worker exits 3 after writing the error, and the caller starts it
again for the folders not in OUT.
"""

import json
import sys
from pathlib import Path


def main() -> None:
    jobs, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    done = {json.loads(line)["name"] for line in out.read_text().splitlines()} if out.is_file() else set()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        temperature=0.0, max_tokens=jobs["max_new"], min_tokens=jobs["max_new"], detokenize=False
    )
    for name, (folder, dtype) in jobs["folders"].items():
        if name in done:
            continue
        record = {"name": name}
        try:
            llm = LLM(
                model=folder,
                skip_tokenizer_init=True,
                dtype=dtype,
                enforce_eager=True,
                enable_prefix_caching=False,
                kv_cache_memory_bytes=1 << 26,  # explicit: engines in one process misread each other's memory
                max_model_len=jobs["max_model_len"],
                seed=0,
            )
            prompts = [TokensPrompt(prompt_token_ids=p) for p in jobs["prompts"]]
            record["tokens"] = [
                list(r.outputs[0].token_ids) for r in llm.generate(prompts, params, use_tqdm=False)
            ]
            del llm
        except Exception as err:  # the probe's answer: what vLLM lacks
            record["error"] = f"{type(err).__name__}: {err}"
        with out.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if "error" in record:
            sys.exit(3)


if __name__ == "__main__":
    main()
