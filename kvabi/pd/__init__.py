"""kvabi's P/D protocol (``specs/pd.md``): one engine hands a request's KV to another, of
any make, layout, block size or tensor-parallel size, under a contract both check.

Owns: the messages (the answer and its reading, grant records, notifications), what binds
them (digests, checksums), the producer's grants, the consumer's pulls, the host tier, the
front/cache-side split an engine drives, and the engine-neutral HTTP proxy.  Imports no
engine; an engine adapter supplies only engine facts (:mod:`kvabi.pd.engine`).

May import: util, model, layout, memory, transfer.
"""
from .cache_side import CacheSide
from .digests import (head_checksums, layout_fingerprint, model_digest, planes_digest,
                      scales_digest, tokens_digest)
from .endpoint import Endpoint
from .engine import CacheGroup, EngineCaches
from .front import Front
from .params import ASK, PD_VERSION, Entry, ParamsReader, RemotePrefill, answer
from .parts import IMAGE, host_parts, kv_part, matching_parts, split_kv, with_shard
from .record import GrantRecord, PartClaim, part_claim
from .settings import DEFAULTS, PDSettings
from .slots import NULL, block_pairs, paired_slots, token_slots, usable_prefix
from .work import Fail, GrantIssue, HostLoad, HostSave, PullWork, Results, Served, StepWork

__all__ = ["ASK", "CacheGroup", "CacheSide", "DEFAULTS", "Endpoint", "EngineCaches", "Entry",
           "Fail", "Front", "GrantIssue", "GrantRecord", "HostLoad", "HostSave", "IMAGE",
           "NULL", "PD_VERSION", "PDSettings", "ParamsReader", "PartClaim", "PullWork",
           "RemotePrefill", "Results", "Served", "StepWork", "answer", "block_pairs",
           "head_checksums", "host_parts", "kv_part", "layout_fingerprint", "matching_parts",
           "model_digest", "paired_slots", "part_claim", "planes_digest", "scales_digest",
           "split_kv", "token_slots", "tokens_digest", "usable_prefix", "with_shard"]
