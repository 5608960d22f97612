"""The torture test's final invariants, checked against ground truth that does not come from
the system under test: the producers' SQLite databases and the writers' input files.

Read with deltalake (no Spark), after quiescence:

* every locally committed order's message, and every sink / ``publish_with_delta_write``
  input row, is in the CommitLog exactly once (after resume + check-back quiescence);
* nothing rolled back, fenced or never written locally is visible; nothing unexpected is;
* the business table of ``publish_with_delta_write`` holds each input row once and agrees
  with the published messages;
* nothing is pending (but the hostile producer's transactions); every visible transaction
  is COMMITted in ``op``; nothing of the hostile producer is visible, and no check-back round
  failed;
* offsets per (topic, queue) are dense from 0 with no repeat; msg ids are unique; a message
  another Delta writer removed (a RESTORE or DELETE of the CommitLog, recorded by the
  orchestrator) may be missing, but a read of its queue must fail with ``DATA_LOSS``; it is
  published again (at a new offset, its old one a hole) only if a RESTORE of ``op`` removed
  its decision too;
* every discarded message is re-driven at most once (and then marked), or still listed;
* in a store of several shards, every table above is read in every shard (found by its marker);
  each transaction's rows (half, op, discard, CommitLog) are in the shard its id names, and
  each CommitLog row's queue is one of its shard's.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

from tests.torture import local_db
from tests.torture.workers import (
    BATCH_TOPIC,
    DELTA_TOPIC,
    HOSTILE_GROUPS,
    HOSTILE_TOPIC,
    PRODUCER_TOPIC,
    STREAM_TOPIC,
    read_delta,
    shard_roots,
)

REDRIVEN_FROM = "REDRIVEN_FROM_TRANSACTION_ID"
#: Most details kept per kind of violation.
MAX_DETAILS = 25


@dataclass(frozen=True)
class Violation:
    invariant: str
    detail: str


@dataclass
class Results:
    violations: list[Violation] = field(default_factory=list)
    facts: dict = field(default_factory=dict)


def _rows(path: str, columns: list[str] | None = None) -> list[dict]:
    return read_delta(path, columns).to_pylist()


def _shard_rows(roots: dict[int, str], name: str, columns: list[str] | None = None) -> list[dict]:
    """Table ``name`` of every shard (``roots``: their roots by index), each row with the index
    of the shard that stores it (``shard``)."""
    return [
        {**row, "shard": k} for k, root in roots.items() for row in _rows(f"{root}/{name}", columns)
    ]


def _decision_objects(roots: dict[int, str]) -> dict[str, str]:
    """Every shard's decision objects (``op/_rmqtx_decisions``): the decision of each
    transaction, found through fsspec."""
    from rmq_spark.delta.storage import filesystem
    from rmq_spark.store.arbiter import DECISIONS_DIR

    found: dict[str, str] = {}
    for root in roots.values():
        fs, path = filesystem(root, {})
        folder = f"{path.rstrip('/')}/op/{DECISIONS_DIR}"
        fs.invalidate_cache(folder)
        try:
            names = [n for n in fs.ls(folder, detail=False) if n.endswith(".json")]
        except FileNotFoundError:
            continue
        for data in fs.cat(names).values():
            body = json.loads(data)
            found[body["transaction_id"]] = body["decision"]
    return found


def _jsonl(path: Path) -> list:
    """The values of a JSON-lines file the orchestrator appends to (none if it never did)."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _props(value) -> dict:
    if value is None:
        return {}
    return dict(value) if not isinstance(value, dict) else value


class _Store:
    """The store's tables (the union of every shard's) as Python rows, each with the index of
    the shard that stores it (``shard``), indexed for diagnostics."""

    def __init__(self, root: str, removed: Path, undecided: Path) -> None:
        self.roots = shard_roots(root)
        from rmq_spark.model.messages import shard_of_queue

        # A store of shards has one CommitLog, the root's; a row's shard is its queue's (the
        # shard that published it), and its transaction must be that shard's.
        stored = [
            {**c, "shard": shard_of_queue(c["queue_id"])}
            for c in _shard_rows(
                {0: self.roots[0]},
                "commitlog",
                ["topic", "queue_id", "queue_offset", "msg_id", "transaction_id", "keys"],
            )
        ]
        # Copies of a message at its offset, stored by another writer's compaction that raced
        # the store's: a read gives each once (rmq_spark.spark.reading._read_once).
        self.commitlog = list(
            {
                (c["shard"], c["topic"], c["queue_id"], c["queue_offset"], c["msg_id"]): c
                for c in stored
            }.values()
        )
        self.copies = len(stored) - len(self.commitlog)
        # Published messages another Delta writer removed: not added back (by a RESTORE), or
        # published again at a new offset (their decisions removed too, by a RESTORE of op).
        visible = {c["msg_id"]: c for c in self.commitlog}
        recorded = list({r["msg_id"]: r for r in _jsonl(removed)}.values())
        self.removed = [r for r in recorded if r["msg_id"] not in visible]
        self.republished = [
            visible[r["msg_id"]]
            for r in recorded
            if r["msg_id"] in visible and visible[r["msg_id"]]["queue_offset"] != r["queue_offset"]
        ]
        #: Queue offsets left empty by another writer (their messages removed, not added back).
        self.holes = {(r["topic"], r["queue_id"], r["queue_offset"]) for r in recorded} - {
            (c["topic"], c["queue_id"], c["queue_offset"]) for c in self.commitlog
        }
        #: Transactions whose decisions another writer's commit on op removed.
        self.undecided = set(_jsonl(undecided))
        self.half = _shard_rows(
            self.roots,
            "half",
            ["transaction_id", "msg_id", "producer_group", "topic", "keys", "properties",
             "sink_id", "epoch", "generation", "store_timestamp"],
        )  # fmt: skip
        self.op_rows = _shard_rows(self.roots, "op")
        self.op = {r["transaction_id"]: r for r in self.op_rows}
        self.discard = _shard_rows(
            self.roots,
            "discard",
            ["transaction_id", "msg_id", "keys", "producer_group", "check_count",
             "redriven_transaction_id"],
        )  # fmt: skip
        self.check_runs = _shard_rows(self.roots, "check_runs", ["status", "discarded", "message"])
        self.epochs = []
        for k, shard_root in self.roots.items():
            try:
                self.epochs += _shard_rows({k: shard_root}, "epochs")
            except Exception:  # another layout: diagnostics only
                pass
        self.epoch_of: dict[str, str] = {}
        for e in self.epochs:
            for t in e.get("transaction_ids") or []:
                self.epoch_of[t] = f"{e['sink_id']}#{e['epoch']} closed by {e['closed_by']}"
        self.half_by_key: dict[str, list[dict]] = defaultdict(list)
        for h in self.half:
            self.half_by_key[h["keys"]].append(h)
        self.visible_by_key: dict[str, list[dict]] = defaultdict(list)
        for c in self.commitlog:
            self.visible_by_key[c["keys"]].append(c)
        self.discard_by_key: dict[str, list[dict]] = defaultdict(list)
        for d in self.discard:
            self.discard_by_key[d["keys"]].append(d)

    def where(self, row: dict) -> str:
        """Which shard stores ``row`` (in a store of several)."""
        return f" in shard {row['shard']}" if len(self.roots) > 1 else ""

    def explain(self, key: str) -> str:
        """Everything the store knows about a business key, for a violation's detail."""
        parts = []
        copies = Counter((h["transaction_id"], h["msg_id"]) for h in self.half_by_key.get(key, []))
        shown = set()
        for h in self.half_by_key.get(key, []):
            txn = h["transaction_id"]
            if (txn, h["msg_id"]) in shown:
                continue
            shown.add((txn, h["msg_id"]))
            if copies[(txn, h["msg_id"])] > 1:
                parts.append(f"[{copies[(txn, h['msg_id'])]} copies in half]")
            op = self.op.get(txn)
            decided = f"{op['decision']} by {op['decided_by']}" if op else "PENDING"
            props = _props(h["properties"])
            extra = []
            if REDRIVEN_FROM in props:
                extra.append(f"re-driven from {props[REDRIVEN_FROM]}")
            if h["sink_id"] is not None:
                extra.append(f"sink {h['sink_id']} epoch {h['epoch']} gen {h['generation']}")
            if txn in self.epoch_of:
                extra.append(f"on the list of epoch {self.epoch_of[txn]}")
            elif h["sink_id"] is not None:
                extra.append("on no epoch's list")
            parts.append(
                f"half txn {txn} msg {h['msg_id']}{self.where(h)}: {decided}; {', '.join(extra)}"
            )
        for d in self.discard_by_key.get(key, []):
            parts.append(
                f"discard txn {d['transaction_id']} msg {d['msg_id']}{self.where(d)} at "
                f"check_count {d['check_count']}, re-driven as {d['redriven_transaction_id']}"
            )
        visible = self.visible_by_key.get(key, [])
        if len(visible) > 3:
            parts.append(f"visible {len(visible)} times, e.g.")
        for c in visible[:3]:
            parts.append(
                f"visible: txn {c['transaction_id']} msg {c['msg_id']} "
                f"queue {c['queue_id']} offset {c['queue_offset']}{self.where(c)}"
            )
        return "; ".join(parts) or "no trace in the store"


def _exactly_once(
    results: Results,
    store: _Store,
    topic: str,
    expected: set[str],
    forbidden: set[str],
    label: str,
    describe=lambda key: "",
) -> dict:
    counts = Counter(c["keys"] for c in store.commitlog if c["topic"] == topic)
    lost = {r["keys"] for r in store.removed if r["topic"] == topic}
    again = {c["keys"] for c in store.republished if c["topic"] == topic}
    missing = sorted(expected - set(counts) - lost)
    dups = sorted(k for k, n in counts.items() if n > 1)
    leaked = sorted(k for k in counts if k in forbidden)
    unexpected = sorted(k for k in counts if k not in expected and k not in forbidden)
    for kind, keys in (
        (f"{label}: committed but not visible", missing),
        (f"{label}: visible more than once", dups),
        (f"{label}: visible but not committed locally", leaked),
        (f"{label}: visible but never an input", unexpected),
    ):
        for key in keys:
            results.violations.append(
                Violation(kind, f"key {key} {describe(key)}: {store.explain(key)}")
            )
    return {
        "expected": len(expected),
        "visible": sum(counts.values()),
        "missing": len(missing),
        "removed by another writer (DATA_LOSS)": len((expected & lost) - set(counts)),
        "removed, then published again": len(expected & again),
        "duplicated": len(dups),
        "leaked": len(leaked) + len(unexpected),
    }


def _data_loss_reported(results: Results, root: str, removed: list[dict]) -> int:
    """Check that a read of each queue another Delta writer removed messages from fails with
    :class:`DataLossError` naming that queue (the reader plans as a query does, from offset 0
    to the next offset of the shard that holds the queue); returns how many queues did."""
    from rmq_spark import DataLossError, Store
    from rmq_spark.model.messages import shard_of_queue
    from rmq_spark.spark.reading import plan_slices

    store = Store.open(root, create=False)
    next_offsets: dict[int, dict[tuple[str, int], int]] = {}
    reported = 0
    for topic, queue in sorted({(r["topic"], r["queue_id"]) for r in removed}):
        shard = store.shard_store(shard_of_queue(queue))
        if shard.shard not in next_offsets:
            next_offsets[shard.shard] = shard.next_offsets()
        end = {topic: {queue: next_offsets[shard.shard][(topic, queue)]}}
        try:
            plan_slices(shard, {topic: {queue: 0}}, end)
        except DataLossError as exc:
            reported += f"{topic} queue {queue} offsets [" in str(exc)
            continue
        results.violations.append(
            Violation(
                "published messages removed without DATA_LOSS",
                f"{topic}/{queue}: a read of offsets [0, {end[topic][queue]}) planned without "
                "an error although another Delta writer removed messages of it",
            )
        )
    return reported


def _in_their_shards(results: Results, store: _Store, shards: int) -> None:
    """The store has the shards the run made it with (and grew it to); each transaction's rows
    (half, op, discard) are in the shard its id names, and each CommitLog row's queue is one of
    that shard's (a shard publishes its own transactions into its own queues)."""
    from rmq_spark.model.messages import shard_of

    if sorted(store.roots) != list(range(shards)):
        results.violations.append(
            Violation(
                "shards missing or unexpected",
                f"the run made {shards} shard(s); found {sorted(store.roots)}",
            )
        )
    misplaced = [
        (table, row, f"transaction {row['transaction_id']} of shard {shard_of(t)}")
        for table, rows in (
            ("half", store.half),
            ("op", store.op_rows),
            ("discard", store.discard),
            ("commitlog", store.commitlog),
        )
        for row in rows
        if (t := row["transaction_id"]) is not None and shard_of(t) != row["shard"]
    ]
    for table, row, what in misplaced[:MAX_DETAILS]:
        results.violations.append(
            Violation(
                "row in another shard than its own",
                f"{table}: {what}"
                + (f", msg {row['msg_id']}" if "msg_id" in row else "")
                + f", is stored in shard {row['shard']}"
                + (f" ({len(misplaced)} rows misplaced)" if len(misplaced) > 1 else ""),
            )
        )


#: A log entry's name (not a staged one, a checkpoint or a hint), with its version.
_ENTRY = re.compile(r"/(\d{20})\.json$")


def _commits(table: str) -> dict[int, list[dict]]:
    """Every log entry of a table (local or on an object store), by version."""
    from rmq_spark.delta.storage import filesystem

    fs, path = filesystem(table, {})
    names = [n for n in fs.ls(f"{path}/_delta_log", detail=False) if _ENTRY.search(n)]
    return {
        int(_ENTRY.search(name).group(1)): [
            json.loads(line) for line in entry.decode().splitlines() if line.strip()
        ]
        for name, entry in fs.cat(names).items()
    }


def _files_removed_twice(table: str) -> list[tuple[str, list[int]]]:
    """Data files that two commits both removed with no commit adding them back in between
    (e.g. two compactions that both committed; a RESTORE that re-adds a file makes its next
    removal a new one)."""
    removed, twice = {}, {}
    for version, actions in sorted(_commits(table).items()):
        for action in actions:
            if "add" in action:
                removed.pop(action["add"]["path"], None)
            elif "remove" in action:
                path = action["remove"]["path"]
                if path in removed:
                    twice.setdefault(path, [removed[path]]).append(version)
                removed[path] = version
    return list(twice.items())


#: How :func:`_operations` names a commit another engine (deltalake) wrote.
FOREIGN = "by another writer"


def _operations(table: str, versions: list[int]) -> list[str]:
    commits, names = _commits(table), []
    for version in versions:
        info = [a["commitInfo"] for a in commits.get(version, []) if "commitInfo" in a]
        first = (info[0] or {}) if info else {}
        foreign = "" if str(first.get("engineInfo", "")).startswith("rmq-spark") else FOREIGN
        names.append(f"v{version} {first.get('operation', '?')} {foreign}".rstrip())
    return names


def _volume(half: list[dict], commitlog: list[dict]) -> dict:
    return {
        "transactions": len({h["transaction_id"] for h in half}),
        "half messages": len(half),
        "visible messages": len(commitlog),
    }


def _shard_facts(store: _Store, shard: int) -> dict:
    """What shard ``shard`` holds, and the producer processes (name.incarnation) whose
    messages it published, with how many."""
    half, visible = (
        [r for r in rows if r["shard"] == shard] for rows in (store.half, store.commitlog)
    )
    producers = Counter(
        ".".join(c["keys"].split(".")[:2]) for c in visible if c["topic"] == PRODUCER_TOPIC
    )
    return {**_volume(half, visible), "producers": dict(producers)}


def check_invariants(run: dict, root: str) -> Results:
    results = Results()
    store = _Store(root, Path(run["foreign_removed"]), Path(run["foreign_undecided"]))
    facts = results.facts

    # ---- producers: the SQLite databases are the truth
    intents: dict[str, dict] = {}
    committed: set[str] = set()
    for spec in run["producers"].values():
        i, o = local_db.read_truth(spec["db"])
        intents.update(i)
        committed |= o
    not_committed = set(intents) - committed

    def describe_intent(key: str) -> str:
        i = intents.get(key)
        if not i:
            return "(no intent)"
        return (
            f"(plan {i['plan']}, local status {i['status']}, stalls {i['stall_checks']}, "
            f"checks {i['checks']})"
        )

    facts["producer"] = _exactly_once(
        results, store, PRODUCER_TOPIC, committed, not_committed, "producer", describe_intent
    )
    facts["producer"]["intents"] = len(intents)
    facts["producer"]["plans"] = dict(Counter(i["plan"] for i in intents.values()))
    facts["producer"]["local status"] = dict(Counter(i["status"] for i in intents.values()))
    discarded_keys = {d["keys"] for d in store.discard if d["producer_group"].startswith("svc-")}
    facts["producer"]["discarded keys"] = len(discarded_keys)
    facts["producer"]["discarded, committed locally (re-driven by resume)"] = len(
        discarded_keys & committed
    )
    facts["producer"]["stalling checkers (past check max)"] = sum(
        1 for i in intents.values() if i["stall_checks"] >= run["check_max"]
    )

    # ---- sinks and publish_with_delta_write: the input files are the truth
    stream_keys = set(read_delta(run["stream_input"], ["key"]).column("key").to_pylist())
    facts["stream sink"] = _exactly_once(
        results, store, STREAM_TOPIC, stream_keys, set(), "stream sink"
    )
    folder = Path(run["batch_inputs"])
    batch_keys = {
        k for p in folder.glob("batch-*.parquet") for k in pq.read_table(p)["key"].to_pylist()
    }
    delta_keys = {
        k for p in folder.glob("delta-*.parquet") for k in pq.read_table(p)["key"].to_pylist()
    }
    facts["batch sink"] = _exactly_once(
        results, store, BATCH_TOPIC, batch_keys, set(), "batch sink"
    )
    facts["batch sink"]["batches"] = len(list(folder.glob("batch-*.parquet")))
    facts["delta publish"] = _exactly_once(
        results, store, DELTA_TOPIC, delta_keys, set(), "publish_with_delta_write"
    )
    business = Path(run["business_table"])
    rows = _rows(business, ["key"]) if (business / "_delta_log").exists() else []
    business_counts = Counter(r["key"] for r in rows)
    facts["delta publish"]["business rows"] = len(rows)
    for key in sorted(delta_keys - set(business_counts))[:MAX_DETAILS]:
        results.violations.append(
            Violation("business table: input row missing", f"key {key}: {store.explain(key)}")
        )
    for key, n in sorted(business_counts.items()):
        if n > 1 or key not in delta_keys:
            results.violations.append(
                Violation("business table: row written twice or never an input", f"key {key} x{n}")
            )
    # Published, and those another Delta writer removed afterwards (a loud DATA_LOSS, above).
    visible_delta = {
        c["keys"] for c in store.commitlog + store.removed if c["topic"] == DELTA_TOPIC
    }
    for key in sorted(set(business_counts) ^ visible_delta)[:MAX_DETAILS]:
        results.violations.append(
            Violation(
                "business table and messages disagree",
                f"key {key}: business rows {business_counts.get(key, 0)}, "
                f"visible {key in visible_delta}; {store.explain(key)}",
            )
        )

    # ---- nothing pending (but the hostile groups' UNKNOWNs); visible means committed
    pending = defaultdict(list)
    for h in store.half:
        if h["transaction_id"] not in store.op and h["producer_group"] not in HOSTILE_GROUPS:
            pending[h["transaction_id"]].append(h)
    for txn, halves in pending.items():
        results.violations.append(
            Violation(
                "still pending after quiescence",
                f"txn {txn} group {halves[0]['producer_group']} ({len(halves)} message(s), e.g. "
                f"key {halves[0]['keys']}): {store.explain(halves[0]['keys'])}",
            )
        )
    # First decision wins: op records the decision of a transaction's decision object.
    objects = _decision_objects(store.roots)
    results.facts["decision_objects"] = len(objects)
    for txn, decision in sorted(objects.items()):
        op = store.op.get(txn)
        if op is not None and op["decision"] != decision:
            results.violations.append(
                Violation(
                    "op records another decision than the decision object",
                    f"txn {txn}: object {decision}, op {op['decision']} by {op['decided_by']}",
                )
            )
    # Retention removes a published transaction's half rows, then its op row: a visible
    # message with no op row is fine once its half rows are gone too.
    staged = {h["transaction_id"] for h in store.half}
    for c in store.commitlog:
        txn = c["transaction_id"]
        op = store.op.get(txn) if txn else None
        expired = op is None and txn not in staged
        if txn and not expired and (op is None or op["decision"] != "COMMIT"):
            results.violations.append(
                Violation(
                    "visible but not COMMITted in op",
                    f"msg {c['msg_id']} txn {c['transaction_id']} decision "
                    f"{op['decision'] if op else 'none'}",
                )
            )

    # ---- offsets dense from 0 but where another writer removed messages, no repeat; msg ids
    # unique; every removed message makes a read fail loudly
    queues = defaultdict(list)
    for c in store.commitlog:
        queues[(c["topic"], c["queue_id"])].append(c["queue_offset"])
    for topic, queue, offset in store.holes:
        queues[(topic, queue)].append(offset)
    for (topic, queue), offsets in sorted(queues.items()):
        offsets.sort()
        if offsets != list(range(len(offsets))):
            repeats = sorted(o for o, n in Counter(offsets).items() if n > 1)[:10]
            gaps = sorted(set(range(max(offsets) + 1)) - set(offsets))[:10]
            results.violations.append(
                Violation(
                    "offsets not dense",
                    f"{topic}/{queue}: {len(offsets)} rows, max {max(offsets)}, repeated "
                    f"{repeats}, missing {gaps}",
                )
            )
    for c in store.republished:
        if c["transaction_id"] not in store.undecided:
            results.violations.append(
                Violation(
                    "removed, then published again though its decision stayed",
                    f"msg {c['msg_id']} txn {c['transaction_id']} now at {c['topic']}/"
                    f"{c['queue_id']} offset {c['queue_offset']}: {store.explain(c['keys'])}",
                )
            )
    for msg_id, n in Counter(c["msg_id"] for c in store.commitlog).items():
        if n > 1:
            results.violations.append(Violation("msg id visible twice", f"msg {msg_id} x{n}"))
    facts["data loss reported"] = _data_loss_reported(results, root, store.removed)
    facts["copies of published messages another writer stored (read once)"] = store.copies
    _in_their_shards(results, store, run.get("shards", 1))

    # ---- discards: re-driven once (and marked) or still listed
    visible_txns = {c["transaction_id"] for c in store.commitlog}
    redrives = defaultdict(set)  # (original txn, msg id) -> re-driven txns found in half
    for h in store.half:
        origin = _props(h["properties"]).get(REDRIVEN_FROM)
        if origin:
            redrives[(origin, h["msg_id"])].add(h["transaction_id"])
    for d in store.discard:
        found = redrives.get((d["transaction_id"], d["msg_id"]), set())
        mark = d["redriven_transaction_id"]
        if len(found) > 1:
            results.violations.append(
                Violation(
                    "discard re-driven more than once",
                    f"msg {d['msg_id']} (key {d['keys']}) of txn {d['transaction_id']} re-driven "
                    f"as {sorted(found)}, marked {mark}; {store.explain(d['keys'])}",
                )
            )
        elif found and mark is None:
            results.violations.append(
                Violation(
                    "discard re-driven but still listed",
                    f"msg {d['msg_id']} re-driven as {sorted(found)} but not marked",
                )
            )
        elif mark == d["transaction_id"]:
            # Published under its own id before the discard (a foreign writer removed its
            # check-max ROLLBACK and a late COMMIT won): the re-drive left it.
            if d["transaction_id"] not in visible_txns:
                results.violations.append(
                    Violation(
                        "discard marked re-driven as itself but not visible",
                        f"msg {d['msg_id']} of txn {mark}",
                    )
                )
        elif mark is not None and mark not in found:
            results.violations.append(
                Violation(
                    "discard marked re-driven but no such half message",
                    f"msg {d['msg_id']} marked {mark}, half has {sorted(found)}",
                )
            )

    # ---- one epochs row per (sink, epoch); a closed epoch's transactions are all committed
    keys = Counter((e["sink_id"], e["epoch"]) for e in store.epochs)
    for (sink, epoch), n in list(keys.items()):
        if n > 1:
            results.violations.append(
                Violation("epoch stored more than once", f"sink {sink} epoch {epoch}: {n} rows")
            )
    for e in store.epochs:
        for t in e.get("transaction_ids") or []:
            decision = store.op.get(t, {}).get("decision")
            if decision is None and t not in staged:
                continue  # published, then removed by retention
            if decision != "COMMIT":
                results.violations.append(
                    Violation(
                        "closed epoch lists a transaction that is not committed",
                        f"sink {e['sink_id']} epoch {e['epoch']}: txn {t} is {decision}",
                    )
                )

    # ---- every half message stored once, but for another writer's copies; no data file
    # removed by two of the store's commits. A deltalake compaction of files the store's
    # compaction rewrote first lands beside it (deltalake lets it), storing their rows twice:
    # identical copies, each read once (rmq_spark.store.reads.once).
    stored = Counter((h["transaction_id"], h["msg_id"]) for h in store.half)
    identical = Counter(tuple(sorted((k, repr(v)) for k, v in h.items())) for h in store.half)
    copies = [(k, n) for k, n in stored.items() if n > 1]
    facts["half messages another writer stored twice (read once)"] = len(copies)
    distinct = sum(stored.values()) - len(stored) - (sum(identical.values()) - len(identical))
    if distinct:
        (txn, msg), n = max(copies, key=lambda c: c[1])
        results.violations.append(
            Violation(
                "half message stored more than once",
                f"{distinct} half message row(s) share a transaction and msg id with a different "
                f"row (e.g. msg {msg} of txn {txn}, x{n}): not another writer's copy",
            )
        )
    tables = ("half", "op", "commitlog", "check_state", "discard", "epochs", "locks")
    # A store of shards has one CommitLog, the root's (shard 0).
    paths = [
        f"{root}/{name}"
        for k, root in store.roots.items()
        for name in tables
        if k == 0 or name != "commitlog"
    ]
    for table in paths:
        for path, versions in _files_removed_twice(table)[:MAX_DETAILS]:
            operations = _operations(table, versions)
            if any(FOREIGN in op for op in operations):
                facts["files another writer's compaction rewrote again"] = (
                    facts.get("files another writer's compaction rewrote again", 0) + 1
                )
                continue
            results.violations.append(
                Violation(
                    "data file removed by two commits (rows duplicated)",
                    f"{table[len(root) + 1 :]}: {path} removed by versions {versions} "
                    f"({', '.join(operations)}): two rewrites of "
                    "the same file both committed, so its rows now exist twice",
                )
            )

    # ---- hostile input: never visible, and it stops no check-back round
    hostile_visible = [c for c in store.commitlog if c["topic"] == HOSTILE_TOPIC]
    if hostile_visible:
        results.violations.append(
            Violation(
                "a hostile producer's message is visible",
                f"{len(hostile_visible)} message(s) of {HOSTILE_TOPIC}, e.g. "
                f"{hostile_visible[0]['msg_id']}: none of its transactions may commit",
            )
        )
    for r in [r for r in store.check_runs if r["status"] != "finished"][:MAX_DETAILS]:
        results.violations.append(
            Violation(
                "check-back round failed",
                f"{(r['message'] or '')[:300]}: no group was checked in that round",
            )
        )

    # ---- what happened, for the report
    facts["decisions"] = dict(
        Counter(f"{o['decided_by']} {o['decision']}" for o in store.op.values())
    )
    facts.update(_volume(store.half, store.commitlog))
    if len(store.roots) > 1:
        facts["shards"] = {k: _shard_facts(store, k) for k in store.roots}
    facts["discard"] = {
        "messages": len(store.discard),
        "transactions": len({d["transaction_id"] for d in store.discard}),
        "re-driven": sum(1 for d in store.discard if d["redriven_transaction_id"]),
        "still listed": sum(1 for d in store.discard if not d["redriven_transaction_id"]),
        "by group": dict(Counter(d["producer_group"] for d in store.discard)),
    }
    facts["check runs"] = {
        "runs": len(store.check_runs),
        "failed": sum(1 for r in store.check_runs if r["status"] != "finished"),
        "failures": dict(
            Counter(
                (r["message"] or "")[:160] for r in store.check_runs if r["status"] != "finished"
            ).most_common(5)
        ),
    }
    # An abort names its write attempt (abort:<id>); counted as one kind.
    closers = (re.sub(r"^abort:.*", "abort", e["closed_by"] or "(open)") for e in store.epochs)
    facts["epochs closed"] = dict(Counter(closers))
    facts["epochs by state"] = dict(Counter(e.get("state") or "CLOSED" for e in store.epochs))
    return results
