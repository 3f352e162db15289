"""kvabi's memory plan decides the pool; transformers' allocator hands out exactly it."""
import kvabi
import kvabi_transformers
from kvabi.memory.planning import plan_memory
from kvabi_transformers.tools.compare import cb_config, run_batch
from kvabi_transformers.model_kv import config_dict

from tf_cases import NEW_TOKENS, baseline, model_of, prompts


def test_pool_is_the_memory_plan(sessions):
    model = model_of("gemma4")
    kvabi_transformers.use(model, "reference", "vllm.BLHNC", block_size=8, memory="256KiB")
    tokens, _ = run_batch(model, prompts(), NEW_TOKENS, config=cb_config(), logits=False)
    assert tokens == baseline("gemma4")[0]
    mkv = kvabi.ModelKV.from_hf_config(config_dict(model.config), block_size=8,
                                       kv_dtype="float32")
    plan = plan_memory(mkv, 256 * 1024, layout="vllm.BLHNC")
    session = sessions[-1]
    want = plan.groups[0].num_blocks
    assert session.num_blocks == want
    assert [lay.num_blocks for lay in session.layouts] == [want] * len(plan.groups)
    assert sum(lay.total_nbytes for lay in session.layouts) == plan.used_bytes <= 256 * 1024


def test_memory_pressure_recomputes_and_keeps_tokens(sessions):
    # 15 blocks of 4 tokens for 7 requests of up to 35 tokens: transformers' scheduler
    # starves requests and soft-resets some (their K/V recomputed later).
    model = kvabi_transformers.use(model_of("gemma4"), block_size=4, memory="30KiB")
    tokens, _ = run_batch(model, prompts(), NEW_TOKENS, config=cb_config(), logits=False)
    assert tokens == baseline("gemma4")[0]
    session = sessions[-1]
    assert session.num_blocks == 15
    total = sum(map(len, prompts())) + len(prompts()) * (NEW_TOKENS - 1)
    assert session.stats["tokens"] > total  # some requests were computed twice
