"""Run one vLLM engine for a JSON job and write a JSON result: `python -m tools.vllm_harness.engine_job
JOB.json OUT.json`. Used by tests/vllm so that every engine runs in its own
process (vLLM's workers re-import the main module; one engine at a time keeps a 2-core box usable).

Job keys: model, llm (kwargs for vllm.LLM), steps: a list of
  {"kind": "generate", "name", "max_tokens", "requests": [{"prompt_ids", "adapter": null | [name, id, path]}]}
      -> per request: tokens, logprobs (of the greedy token), seconds for the whole batch
  {"kind": "collectives", "name", "prompt_ids", "adapter"}  -> TP-group collective calls of one forward
  {"kind": "refuse", "name", "adapter", "prompt_ids"} -> the error raised when the adapter is used (or None)
(scripts/bench_serving.py measures through `vllm serve` and `vllm bench serve` instead.)
"""

from __future__ import annotations

import json
import sys
import time
import traceback


def _lora_request(adapter):
    if adapter is None:
        return None
    from vllm.lora.request import LoRARequest

    name, lora_id, path = adapter
    return LoRARequest(name, int(lora_id), path)


def _generate(llm, step):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=step["max_tokens"], logprobs=0, ignore_eos=True)
    requests = step["requests"]
    prompts = [{"prompt_token_ids": r["prompt_ids"]} for r in requests]
    loras = [_lora_request(r.get("adapter")) for r in requests]
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    seconds = time.perf_counter() - t0
    results = []
    for out in outputs:
        comp = out.outputs[0]
        lps = [float(step_lp[tok].logprob) for tok, step_lp in zip(comp.token_ids, comp.logprobs)]
        metrics = getattr(out, "metrics", None)
        results.append({"tokens": list(comp.token_ids), "logprobs": lps,
                        "metrics": {k: getattr(metrics, k) for k in ("first_token_latency", "arrival_time")
                                    if metrics is not None and isinstance(getattr(metrics, k, None), float)}})
    return {"results": results, "seconds": seconds}


def _collectives(llm, step):
    from vllm import SamplingParams

    from tools.vllm_harness import probe

    llm.collective_rpc(probe.install_counter)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    lora = _lora_request(step.get("adapter"))
    # warm the adapter into its slot first so the counted call is one forward, not a load
    llm.generate([{"prompt_token_ids": step["prompt_ids"]}], params, lora_request=lora, use_tqdm=False)
    llm.collective_rpc(probe.reset_counter)
    llm.generate([{"prompt_token_ids": step["prompt_ids"]}], params, lora_request=lora, use_tqdm=False)
    return {"per_rank": llm.collective_rpc(probe.read_counter)}


def _refuse(llm, step):
    try:
        llm.llm_engine.add_lora(_lora_request(step["adapter"]))
        from vllm import SamplingParams

        llm.generate([{"prompt_token_ids": step["prompt_ids"]}], SamplingParams(max_tokens=1),
                     lora_request=_lora_request(step["adapter"]), use_tqdm=False)
    except Exception as e:  # noqa: BLE001 - the test inspects the message
        return {"error": f"{type(e).__name__}: {e}"}
    return {"error": None}


def run(job: dict) -> dict:
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(model=job["model"], **job["llm"])
    result = {"load_seconds": time.perf_counter() - t0, "steps": {}}
    for step in job["steps"]:
        fn = {"generate": _generate, "collectives": _collectives, "refuse": _refuse}[step["kind"]]
        result["steps"][step["name"]] = fn(llm, step)
    result["total_seconds"] = time.perf_counter() - t0
    return result


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    job_path, out_path = argv
    with open(job_path) as f:
        job = json.load(f)
    try:
        result = run(job)
    except Exception:  # noqa: BLE001 - reported to the caller in the result file
        result = {"error": traceback.format_exc()}
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
