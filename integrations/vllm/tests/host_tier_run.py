"""One engine with KvabiConnector's host tier, run in its own process by the tests:
``python host_tier_run.py MODEL BLOCK_SIZE OUT.json [CONNECTOR_MODULE]``.

Turn 1 generates from the prompts (their blocks are saved to the host tier when they
finish).  The reference then computes turn 2 (each prompt + its turn-1 answer + new tokens)
with the host tier off for those requests (``kvabi_host: False``); then the same turn 2 runs
with it on, loading the saved prefix, twice (the negative control's connector corrupts the
second run's loads).  Prefix caching is off, so a hit can only come from the host tier."""
import json
import sys

if __name__ == "__main__":
    from kvabi_vllm.tools.checkpoints import prompts
    from kvabi_vllm.tools.pd import _sampling, make_llm
    from vllm.inputs import TokensPrompt

    model, bs, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    module = sys.argv[4] if len(sys.argv) > 4 else "kvabi_vllm.connector"
    llm = make_llm(model, block_size=bs, role="kv_both", module=module,
                   extra={"host_blocks": 64})
    first = prompts(3, lengths=(45, 70, 100), shared_prefix=0, seed=1)
    gen = 16
    t1 = llm.generate([TokensPrompt(prompt_token_ids=p) for p in first],
                      _sampling(gen), use_tqdm=False)
    second = [p + list(o.outputs[0].token_ids) + [7, 11, 13] for p, o in zip(first, t1)]
    tp = [TokensPrompt(prompt_token_ids=p) for p in second]
    ref = llm.generate(tp, [_sampling(gen, {"kvabi_host": False}) for _ in tp], use_tqdm=False)
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    conn = get_kv_transfer_group().connector_worker
    before = dict(conn.host_stats)
    hit = llm.generate(tp, _sampling(gen), use_tqdm=False)
    mid = dict(conn.host_stats)
    # the negative control's connector corrupts loads from request 3 * len(tp) on: this run
    again = llm.generate(tp, _sampling(gen), use_tqdm=False)
    json.dump({"ref": [list(o.outputs[0].token_ids) for o in ref],
               "hit": [list(o.outputs[0].token_ids) for o in hit],
               "again": [list(o.outputs[0].token_ids) for o in again], "stats_mid": mid,
               "stats_before": before, "stats": conn.host_stats,
               "corrupted": getattr(type(conn), "corrupted", 0)}, open(out, "w"))
