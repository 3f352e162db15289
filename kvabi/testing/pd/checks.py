"""The P/D kit's checks (``specs/pd.md`` section 12): each runs reference peers
(:class:`~.reference.ReferenceEngine`) against the engine under test in one role and says
what did not hold.

Consumer role (the engine pulls): honest pulls from producers of other layouts, block sizes
and TP sizes, byte-exact; forged, malformed and replayed parameters refused by field, the
victims' grants untouched; lying, corrupting, frozen and dying producers refused by field
within the deadline.  Producer role (the engine serves): honest consumers of other layouts,
block sizes and TP sizes read byte-exact what the engine computed; forged and replayed
notifications free nothing; a consumer that gives up after binding frees the blocks; a
grant nobody reads expires.  Both: nothing held afterwards.
"""
from __future__ import annotations

import copy
import json
import time

import attrs
import numpy as np

from ...pd import PDSettings
from .engine import EngineUnderTest, ModelFacts
from .reference import SLACK, ReferenceEngine
from .values import differences

#: the bounds the kit starts engines and peers with (short: the kit waits for them)
SETTINGS = PDSettings(pull_timeout_s=8.0, hold_timeout_s=8.0, max_held=32, max_pulls=32,
                      pull_threads=4, max_peers=16)
#: table entries that must return to 0 when an engine is idle
IDLE_KEYS = ("entries", "held", "pulls", "grants", "sent", "finished", "saved", "saving",
             "held_requests")


@attrs.frozen
class CheckResult:
    """One check's outcome: ``problems`` empty when it held; ``notes`` what it did."""

    name: str
    problems: tuple = ()
    notes: tuple = ()
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems


class Context:
    """What the checks of one run share: the engine, its facts, the kit's settings, a
    source of prompts, and the reference peers started for it (stopped at the end)."""

    def __init__(self, engine: EngineUnderTest, settings: PDSettings = SETTINGS, seed: int = 0):
        self.engine = engine
        self.facts: ModelFacts = engine.facts()
        self.settings = settings
        self.rng = np.random.default_rng(seed)
        self.peers: list[ReferenceEngine] = []
        self._n = 0

    def prompts(self, count: int, length: int | None = None) -> list:
        f = self.facts
        length = length or 2 * f.block_size + 5
        return [self.rng.integers(1, f.vocab, length).tolist() for _ in range(count)]

    def rid(self, what: str) -> str:
        self._n += 1
        return f"kit-{what}-{self._n}"

    def peer(self, role: str, **kw) -> ReferenceEngine:
        p = ReferenceEngine(self.facts if "facts" not in kw else kw.pop("facts"),
                            label=f"kit-peer{len(self.peers)}", **kw)
        p.start(role, self.settings)
        self.peers.append(p)
        return p

    def close(self) -> None:
        for p in self.peers:
            p.stop()
        self.peers = []

    def deadline(self) -> float:
        return self.settings.pull_timeout_s + SLACK


def shapes(facts: ModelFacts) -> list[tuple[str, int, int]]:
    """(preset, block size, TP size) of the reference peers an engine meets: other axis
    orders, smaller, larger and equal block sizes, cross-layer blocks, TP 2 where the
    model's KV heads split."""
    bs = facts.block_size
    tp2 = 2 if facts.num_kv_heads % 2 == 0 else 1
    return [("vllm.LBHNC", max(bs // 2, 1), 1), ("flashinfer.HND", 2 * bs, 1),
            ("vllm.BLHNC", bs, tp2), ("flashinfer.NHD", 16, tp2)]


def _refused(outcome, fields) -> str | None:
    """None when ``outcome`` is a refusal whose message opens with one of ``fields``;
    else what is wrong."""
    if outcome is None:
        return "no outcome"
    why = outcome.reason
    if why is None:
        return "accepted"
    if not any(why.startswith(f) and why[len(f):len(f) + 1] in (":", "[", ".", " ", "")
               for f in fields):
        return f"refused naming another field than {' or '.join(fields)}: {why[:160]}"
    return None


def _idle(ctx: Context, who: EngineUnderTest, problems: list, what: str) -> None:
    t = who.tables()
    busy = {k: v for k, v in t.items() if k in IDLE_KEYS and v}
    if busy:
        problems.append(f"{what}: tables not empty when idle: {busy}")
    b = who.blocks()
    if b is not None and b[0] != b[1]:
        problems.append(f"{what}: {b[1] - b[0]} of {b[1]} blocks still held")


# -- consumer role -----------------------------------------------------------------------------
def consumer_honest(ctx: Context) -> CheckResult:
    """Pulls from producers of other layouts, block sizes and TP sizes arrive byte-exact,
    and a decode prompt longer than the prefilled one pulls the prefix."""
    problems, notes = [], []
    for preset, bs, tp in shapes(ctx.facts):
        prod = ctx.peer("producer", preset=preset, block_size=bs, tp=tp)
        prompts = ctx.prompts(2)
        answers = prod.prefill(prompts)
        reqs = [(ctx.rid("honest"), prompts[0], answers[0]),
                (ctx.rid("longer"), prompts[1] + [3, 1, 4], answers[1])]
        got = ctx.engine.decode(reqs)
        for (rid, _, ans), what in zip(reqs, ("", " (a longer prompt)")):
            o = got.get(rid)
            if o is None or o.reason is not None:
                problems.append(f"from {prod.name}{what}: refused: {o and o.reason}")
                continue
            if o.kv is None:
                problems.append(f"from {prod.name}{what}: the engine showed no KV")
                continue
            diff = differences(o.kv, prod.kv(ans))
            problems += [f"from {prod.name}{what}: {d}" for d in diff[:4]]
        prod.step(0.2)
        _idle(ctx, prod, problems, prod.name)
        notes.append(prod.name)
    return CheckResult("consumer.honest", tuple(problems), tuple(notes))


def _handshake(p: dict, part: str, edit) -> None:
    place = p["kvabi_handshakes"][0][part]
    msgs = place if isinstance(place, list) else [place]
    out = []
    for m in msgs:
        d = json.loads(m)
        edit(d)
        out.append(json.dumps(d))
    p["kvabi_handshakes"][0][part] = out if isinstance(place, list) else out[0]


def _forgeries(a: dict, b: dict, prompt_len: int) -> list:
    """(what, edit of a copy of ``a``, the fields the refusal may name): ``b`` is another
    live request's answer (the victim)."""
    def shift(d):
        d["planes"]["address"][0] += 64

    def scales(d):
        d["kv_scales"] = [[1.5, 1.5]] * d["layout"]["sizes"].get("L", 1)

    return [
        ("not an object", lambda p: [p], ("kv_transfer_params",)),
        ("no grant", lambda p: p.pop("kvabi_grant"), ("kvabi_grant",)),
        ("another protocol major", lambda p: p.update(kvabi_pd=[2, 0]), ("kvabi_pd",)),
        ("more tokens than the prompt", lambda p: p.update(remote_num_tokens=prompt_len + 1),
         ("remote_num_tokens",)),
        ("a block twice", lambda p: p["remote_block_ids"][0].__setitem__(
            -2, p["remote_block_ids"][0][-1]), ("remote_block_ids[0]",)),
        ("the null block where KV must be", lambda p: p["remote_block_ids"][0].__setitem__(
            -1, -1), ("remote_block_ids[0]",)),
        ("another request's blocks", lambda p: p.update(
            remote_block_ids=copy.deepcopy(b["remote_block_ids"])), ("remote_block_ids[0]",)),
        ("another request's grant", lambda p: p.update(copy.deepcopy(b)), ("kvabi_grant",)),
        ("a forged nonce on a live slot", lambda p: p["kvabi_grant"].update(
            slot=b["kvabi_grant"]["slot"], nonce="0" * 32), ("kvabi_grant",)),
        ("a plane shifted", lambda p: _handshake(p, "kv", shift), ("kvabi_handshakes[0]",)),
        ("kv_scales the producer did not state", lambda p: _handshake(p, "kv", scales),
         ("kvabi_handshakes[0]",)),
        ("a model the producer did not state", lambda p: _handshake(
            p, "kv", lambda d: d.update(model="another-model")), ("kvabi_handshakes[0]",)),
        ("keys served as values", lambda p: p["kvabi_handshakes"][0].update(
            k=p["kvabi_handshakes"][0]["v"], v=p["kvabi_handshakes"][0]["k"]) or
         p["kvabi_handshakes"][0].pop("kv"), ("kvabi_handshakes[0]",)),
        ("a cache served as the grant table", lambda p: p.update(
            kvabi_grants=p["kvabi_handshakes"][0]["kv"]), ("kvabi_grants",)),
    ]


def consumer_forged(ctx: Context) -> CheckResult:
    """Malformed and forged parameters are refused by field, each request alone: an honest
    request beside them gets its KV, and the victims' grants survive (they read after)."""
    problems = []
    prod = ctx.peer("producer", preset="flashinfer.HND")  # it serves k and v apart too
    n_forged = len(_forgeries({"remote_block_ids": [[0]]}, {}, 0))
    prompts = ctx.prompts(n_forged + 3)
    answers = prod.prefill(prompts)
    victim, honest = answers[-2], answers[-1]
    reqs, want = [], {}
    for (what, edit, fields), prompt, ans in zip(
            _forgeries(answers[0], victim, len(prompts[0])), prompts, answers):
        p = copy.deepcopy(ans)
        out = edit(p)
        rid = ctx.rid("forged")
        reqs.append((rid, prompt, out if isinstance(out, list) else p))
        want[rid] = (what, fields)
    reqs.append((ctx.rid("beside"), prompts[-1], honest))
    got = ctx.engine.decode(reqs)
    for rid, (what, fields) in want.items():
        bad = _refused(got.get(rid), fields)
        if bad:
            problems.append(f"{what}: {bad}")
    o = got.get(reqs[-1][0])
    if o is None or o.reason is not None:
        problems.append(f"an honest request beside them: refused: {o and o.reason}")
    later = ctx.engine.decode([(ctx.rid("victim"), prompts[-2], victim)])
    o = next(iter(later.values()))
    if o.reason is not None:
        problems.append(f"the victim of the forgeries, read after them: {o.reason}")
    if ctx.facts.num_kv_heads % 2 == 0:  # a TP-2 producer's ranks listed in swapped order
        tp2 = ctx.peer("producer", tp=2)
        prompt = ctx.prompts(1)[0]
        (ans,) = tp2.prefill([prompt])
        p = copy.deepcopy(ans)
        p["kvabi_grants"] = p["kvabi_grants"][::-1]
        p["kvabi_handshakes"] = [{k: v[::-1] for k, v in g.items()}
                                 for g in p["kvabi_handshakes"]]
        got = ctx.engine.decode([(ctx.rid("swapped-ranks"), prompt, p)])
        bad = _refused(next(iter(got.values())), ("kvabi_grants[0]", "kvabi_handshakes[0]"))
        if bad:
            problems.append(f"a producer's ranks swapped: {bad}")
    return CheckResult("consumer.forged", tuple(problems), (f"{len(want)} forgeries",))


def consumer_replay(ctx: Context) -> CheckResult:
    """A grant pulled once is refused the second time (``kvabi_grant``)."""
    prod = ctx.peer("producer")
    prompt = ctx.prompts(1)[0]
    (ans,) = prod.prefill([prompt])
    first = ctx.engine.decode([(ctx.rid("first"), prompt, ans)])
    again = ctx.engine.decode([(ctx.rid("replay"), prompt, copy.deepcopy(ans))])
    problems = []
    o = next(iter(first.values()))
    if o.reason is not None:
        problems.append(f"the first pull: refused: {o.reason}")
    bad = _refused(next(iter(again.values())), ("kvabi_grant",))
    if bad:
        problems.append(f"the replay: {bad}")
    return CheckResult("consumer.replay", tuple(problems))


#: a hostile producer's fault -> the fields the engine's refusal may name
HOSTILE = {
    "lie_tokens": ("kvabi_grant",),
    "lie_blocks": ("remote_block_ids[0]",),
    "lie_checksums": ("kvabi_grant",),
    "lie_layout": ("kvabi_handshakes[0]",),
    "corrupt": ("kvabi_grant",),
    "frozen": ("kvabi_grant", "pull"),
    "dying": ("peer", "transfer", "kvabi_grant", "pull"),
}


def consumer_hostile(ctx: Context) -> CheckResult:
    """Lying, corrupting, frozen and dying producers: each request refused by field within
    the pull deadline, an honest request beside each served."""
    problems, notes = [], []
    honest = ctx.peer("producer")
    for fault, fields in HOSTILE.items():
        bad_peer = ctx.peer("producer", fault=fault)
        p1, p2 = ctx.prompts(2)
        (a1,) = bad_peer.prefill([p1])
        (a2,) = honest.prefill([p2])
        t0 = time.monotonic()
        got = ctx.engine.decode([(ctx.rid(fault), p1, a1), (ctx.rid("beside"), p2, a2)])
        (r1, o1), (_, o2) = sorted(got.items(), key=lambda kv: "beside" in kv[0])
        bad = _refused(o1, fields)
        if bad:
            problems.append(f"a {fault} producer: {bad}")
        if o1.seconds > ctx.deadline() or time.monotonic() - t0 > ctx.deadline() + 30:
            problems.append(f"a {fault} producer: answered after {o1.seconds:.1f} s "
                            f"(pull_timeout_s {ctx.settings.pull_timeout_s:g})")
        if o2.reason is not None:
            problems.append(f"beside a {fault} producer, an honest request: {o2.reason}")
        notes.append(f"{fault}: {o1.reason and o1.reason[:70]}")
        bad_peer.stop()
    return CheckResult("consumer.hostile", tuple(problems), tuple(notes))


def consumer_idle(ctx: Context) -> CheckResult:
    """After all the above, the engine holds nothing for them."""
    problems = []
    ctx.engine.step(0.5)
    _idle(ctx, ctx.engine, problems, ctx.engine.name)
    return CheckResult("consumer.idle", tuple(problems))


# -- producer role -----------------------------------------------------------------------------
def producer_honest(ctx: Context) -> CheckResult:
    """Consumers of other layouts, block sizes and TP sizes read byte-exact what the engine
    computed; the engine then frees the blocks."""
    problems, notes = [], []
    for preset, bs, tp in shapes(ctx.facts):
        cons = ctx.peer("consumer", preset=preset, block_size=bs, tp=tp)
        prompts = ctx.prompts(2)
        answers = ctx.engine.prefill(prompts)
        truth = [ctx.engine.kv(a) if a else None for a in answers]
        reqs = [(ctx.rid("honest"), p, a) for p, a in zip(prompts, answers)]
        got = cons.decode(reqs)
        for (rid, _, ans), want in zip(reqs, truth):
            o = got[rid]
            if ans is None:
                problems.append(f"to {cons.name}: the engine answered without parameters")
            elif o.reason is not None:
                problems.append(f"to {cons.name}: refused: {o.reason}")
            else:
                problems += [f"to {cons.name}: {d}" for d in differences(o.kv, want)[:4]]
        notes.append(cons.name)
        _idle(ctx, cons, problems, cons.name)
    ctx.engine.step(0.5)
    return CheckResult("producer.honest", tuple(problems), tuple(notes))


def producer_notifications(ctx: Context) -> CheckResult:
    """Notifications that name no live grant (another nonce, another slot, garbage, another
    size) free nothing: the consumer reads after them; a replayed notification after the
    release frees nothing either."""
    from ...pd.notify import notify_message
    from ...transfer.nixl import NixlAgent

    problems = []
    prompt = ctx.prompts(1)[0]
    (ans,) = ctx.engine.prefill([prompt])
    if ans is None:
        return CheckResult("producer.notifications", ("the engine answered without "
                                                      "parameters",))
    slot, nonce = ans["kvabi_grant"]["slot"], bytes.fromhex(ans["kvabi_grant"]["nonce"])
    grants = ans["kvabi_grants"] if isinstance(ans["kvabi_grants"], list) else \
        [ans["kvabi_grants"]]
    attacker = NixlAgent("kit-attacker", host="127.0.0.1")
    try:
        peers = [attacker.connect(m, timeout=10) for m in grants]
        forged = [notify_message(slot, bytes(16)), notify_message(slot + 1, nonce),
                  b"kvabi.pull:garbage", notify_message(slot, nonce[::-1], 0, 1),
                  b"kvabi.pull:%d:%s:0/65" % (slot, nonce.hex().encode())]
        for peer in peers:
            for note in forged:
                attacker.notify(peer, note)
        ctx.engine.step(1.0)
        cons = ctx.peer("consumer")
        o = next(iter(cons.decode([(ctx.rid("after-forged"), prompt, ans)]).values()))
        if o.reason is not None:
            problems.append(f"after forged notifications, the consumer: {o.reason}")
        ctx.engine.step(0.5)
        for peer in peers:  # the honest notification again, after the release
            attacker.notify(peer, notify_message(slot, nonce, 0, 1))
        ctx.engine.step(0.5)
    finally:
        attacker.close()
    _idle(ctx, ctx.engine, problems, ctx.engine.name)
    return CheckResult("producer.notifications", tuple(problems))


def producer_gave_up(ctx: Context) -> CheckResult:
    """A consumer that binds the grant and then gives up (here: another dtype, refused by
    negotiation) notifies the engine, which frees the blocks well before hold_timeout_s."""
    problems = []
    other = "float16" if ctx.facts.dtype != "float16" else "float32"
    cons = ctx.peer("consumer", facts=attrs.evolve(ctx.facts, dtype=other))
    prompt = ctx.prompts(1)[0]
    (ans,) = ctx.engine.prefill([prompt])
    o = next(iter(cons.decode([(ctx.rid("gives-up"), prompt, ans)]).values()))
    bad = _refused(o, ("kvabi_handshakes[0]",))
    if bad:
        problems.append(f"a consumer of another dtype: {bad}")
    t0 = time.monotonic()
    while time.monotonic() - t0 < ctx.settings.hold_timeout_s / 2:
        ctx.engine.step(0.2)
        if not any(v for k, v in ctx.engine.tables().items() if k in IDLE_KEYS):
            break
    _idle(ctx, ctx.engine, problems, f"{ctx.engine.name}, before hold_timeout_s")
    return CheckResult("producer.gave_up", tuple(problems))


def producer_expiry(ctx: Context) -> CheckResult:
    """A grant nobody reads expires after hold_timeout_s: the blocks come back, and a late
    consumer is refused (``kvabi_grant``)."""
    problems = []
    prompt = ctx.prompts(1)[0]
    (ans,) = ctx.engine.prefill([prompt])
    ctx.engine.step(ctx.settings.hold_timeout_s + 1.5)
    _idle(ctx, ctx.engine, problems, ctx.engine.name)
    cons = ctx.peer("consumer")
    bad = _refused(next(iter(cons.decode([(ctx.rid("late"), prompt, ans)]).values())),
                   ("kvabi_grant",))
    if bad:
        problems.append(f"a consumer after the expiry: {bad}")
    return CheckResult("producer.expiry", tuple(problems))


def producer_idle(ctx: Context) -> CheckResult:
    problems = []
    ctx.engine.step(0.5)
    _idle(ctx, ctx.engine, problems, ctx.engine.name)
    return CheckResult("producer.idle", tuple(problems))


#: role -> the checks, in the order they run
CHECKS = {
    "consumer": (consumer_honest, consumer_forged, consumer_replay, consumer_hostile,
                 consumer_idle),
    "producer": (producer_honest, producer_notifications, producer_gave_up, producer_expiry,
                 producer_idle),
}
CHECK_NAMES = tuple(f"{role}.{f.__name__.split('_', 1)[1]}" for role, fs in CHECKS.items()
                    for f in fs)

__all__ = ["CHECKS", "CHECK_NAMES", "CheckResult", "Context", "SETTINGS", "shapes"]
