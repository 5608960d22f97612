"""The torture test's printed report."""

from __future__ import annotations

from collections import defaultdict

#: Details printed per kind of violation (all are in report.json).
SHOWN_PER_KIND = 8


def _counter(c) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(dict(c).items())) or "none"


def format_report(result: dict) -> str:
    s, facts, violations = result["stats"], result["facts"], result["violations"]
    minutes = max(float(result["chaos_seconds"]) / 60, 0.1)
    shards = result["options"].get("shards", "1")
    shards = f" SHARDS={shards}" if shards != "1" else ""
    lines = [
        "=" * 78,
        f"rmq-spark torture report   seed {result['seed']}   "
        f"{'PASS' if not violations else f'FAIL ({len(violations)} violation(s))'}",
        "=" * 78,
        f"replay:      make torture SEED={result['seed']} MINUTES={minutes:.1f}{shards}",
        f"duration:    {result['duration_seconds']:.0f} s (chaos until "
        f"{result['chaos_seconds']:.0f} s, after {s.warm_up:.0f} s of warm-up)",
        f"run dir:     {result['root']} (logs/, report.txt, store/)",
        f"processes:   {sum(s.started.values())} started: {_counter(s.started)}",
        f"kills:       SIGKILL by the orchestrator {sum(s.kills.values())}: {_counter(s.kills)}",
        f"             failpoints armed {_counter(s.failpoints_armed)}; "
        f"self-kills at failpoints {_counter(s.failpoint_kills)}",
        f"exits:       {_counter(s.exits)}",
        f"resumes:     {s.resumes} (of which {s.resumes_concurrent} pairs at once)",
        f"meddling:    {_counter(s.meddling)} (another Delta writer; stall = SIGSTOP/SIGCONT); "
        f"{s.messages_removed} published message(s) removed",
        f"inputs:      {s.stream_files} stream files, {s.batch_inputs} batch + delta inputs",
        f"sampling:    {s.samples} samples of check_state / queue offsets; "
        f"highest check_count seen {s.max_check_count}",
    ]
    lines.append("messages:")
    for kind in ("producer", "stream sink", "batch sink", "delta publish"):
        f = dict(facts.get(kind, {}))
        head = ", ".join(
            f"{k} {f.pop(k)}" for k in ("expected", "visible", "missing", "duplicated", "leaked")
        )
        lines.append(f"  {kind:<14}{head}")
        for k, v in f.items():
            lines.append(f"  {'':<14}{k}: {_counter(v) if isinstance(v, dict) else v}")
    lines.append(
        f"store:       {facts['transactions']} transactions, {facts['half messages']} half "
        f"messages, {facts['visible messages']} visible"
    )
    for k, f in (facts.get("shards") or {}).items():
        lines.append(
            f"  shard {k}:   {f['transactions']} transactions, {f['half messages']} half "
            f"messages, {f['visible messages']} visible; producer messages by process "
            f"{_counter(f['producers'])}"
        )
    lines.append(f"decisions:   {_counter(facts['decisions'])}")
    d = facts["discard"]
    lines.append(
        f"discards:    {d['messages']} message(s) in {d['transactions']} transaction(s); "
        f"re-driven {d['re-driven']}, still listed {d['still listed']}; by group "
        f"{_counter(d['by group'])}"
    )
    cr = facts["check runs"]
    lines.append(f"check-back:  {cr['runs']} runs, {cr['failed']} failed")
    for message, n in cr["failures"].items():
        lines.append(f"             x{n} {message}")
    lines.append(f"epochs:      closed by {_counter(facts['epochs closed'])}")
    lines.append(f"             states {_counter(facts['epochs by state'])}")
    loud = facts.get("loud failures") or {}
    lines.append(
        "loud failures (allowed: raised, then retried by the harness as an operator would): "
        + (", ".join(f"{k} x{v['count']}" for k, v in loud.items()) or "none")
    )
    for v in loud.values():
        lines.append(f"             e.g. {v['example'][:240]}")
    rounds = s.quiesce_rounds
    if rounds:
        last = rounds[-1]
        lines.append(
            f"quiescence:  {len(rounds)} round(s) (finisher attempts {s.finish_attempts}); "
            f"re-driven {sum(r['redriven'] for r in rounds)}; last: pending {last['pending']}, "
            f"undriven discards {last['undriven_discards']}"
        )
    else:
        lines.append(f"quiescence:  no round completed (finisher attempts {s.finish_attempts})")
    if s.unexpected_exits:
        lines.append(
            f"unexpected worker exits ({len(s.unexpected_exits)}; not violations by themselves):"
        )
        for name, inc, rc, tail in s.unexpected_exits[:12]:
            lines.append(f"  {name}#{inc} rc={rc}: {tail[-400:]}")
    by_kind = defaultdict(list)
    for v in violations:
        by_kind[v.invariant].append(v.detail)
    lines.append(f"violations:  {len(violations)}")
    for kind, details in by_kind.items():
        lines.append(f"  [{kind}] x{len(details)}")
        for detail in details[:SHOWN_PER_KIND]:
            lines.append(f"    - {detail[:1200]}")
        if len(details) > SHOWN_PER_KIND:
            lines.append(f"    ... {len(details) - SHOWN_PER_KIND} more in report.json")
    lines.append("=" * 78)
    return "\n".join(lines)
