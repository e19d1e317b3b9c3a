"""Chaos: kill -9 a random rank of a generated program at random moments and check that training still ends with the
uninterrupted run's per-step losses (issue 30).

    python benchmarks/chaos.py [--layouts dp,fsdp,tp_sp,pp_1f1b,pp_interleaved,cp,ep] [--kills N] [--steps S]
                               [--checkpoint-every K] [--dropout on,off] [--seed 0] [--work DIR]

For each layout (LAYOUTS: a tiny model planned with that layout pinned, on 2 CPU processes with gloo) and each dropout
setting (on: the model's dropout as it trains; off: every dropout the identity, as under autoplan verify:
AUTOPLAN_VERIFY, runtime/harness/hooks.py), it runs the launcher the output folder
ships, `bash launch/torchrun.sh --device cpu --steps S ...` (periodic checkpoints every K steps, CHECKPOINT_EVERY;
torchrun restarts failed processes, MAX_RESTARTS = N, and a restarted train.py resumes from the newest checkpoint on
its own), twice:
  uninterrupted  MAX_RESTARTS=0, nothing killed;
  chaos          N times, a random rank is killed with SIGKILL at a random moment: during a step (after a random
                 number of steps of the current attempt) or during a checkpoint write (while DIR/.step_<k>.partial/
                 exists: the ranks are inside torch.distributed.checkpoint.save), each with probability 1/2.
The per-step losses come from rank 0's --metrics-out (the steps it trained, "first_step" where the attempt resumed),
read while each attempt runs and once it has died: the final loss of step t is the one of the last attempt that
trained it. The run is "identical" when the final losses equal the uninterrupted run's bit for bit (JSON floats);
steps a killed attempt trained after its last checkpoint and the next attempt trained again are compared too.
"steps lost" per kill: steps the killed attempt had finished minus the step the next attempt resumed from.

Seeded (--seed): the kinds, the ranks, the moments. What it cannot seed is the operating system's timing: a kill
aimed at a checkpoint write lands in one only if the write lasts longer than the polling (it says so: "missed").
Prints one line per kill and one per run; exits 1 when a run is not identical.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "benchmarks" / "models"

LAYOUTS = {
    "dp": ("chaos_gpt.py", "dp=2,zero=0,compile=off"),
    "fsdp": ("chaos_gpt.py", "dp=2,zero=3,compile=off"),
    "tp_sp": ("chaos_gpt.py", "tp=2,sp=on,compile=off"),
    "pp_1f1b": ("chaos_gpt.py", "pp=2,schedule=1f1b,compile=off"),
    "pp_interleaved": ("chaos_gpt.py", "pp=2,schedule=interleaved,compile=off"),
    "cp": ("chaos_gpt_ring.py", "cp=2,compile=off"),  # no attention-weight dropout: the ring runs none
    "ep": ("chaos_moe.py", "dp=2,zero=3,ep=2,compile=off"),
}
"""Layout name -> (model file in benchmarks/models/, autoplan --pin). compile=off: torch.compile on CPU builds C++ for
minutes at every restart, and what is measured here is resuming, not compiling."""
GPUS = 2
GLOBAL_BATCH = 8
PLANNED_FOR = "h100-sxm5-80gb"
"""The layouts are pinned and the program runs on CPU processes whatever it was planned for: planning for a GPU
profile with estimated op times (measure=False) takes seconds where timing every op on this CPU takes minutes."""
POLL_S = 0.002
"""How often the benchmark looks at the checkpoint folder and the metrics file (a tiny model's checkpoint write
lasts tens of milliseconds on CPU)."""


@dataclass
class Kill:
    kind: str
    """"step" or "checkpoint" (aimed at a checkpoint write)."""
    rank: int
    at_step: int | None = None
    """Steps the killed attempt had finished when it died (from rank 0's metrics)."""
    resumed_from: int | None = None
    """The step the next attempt started at (its metrics' first_step)."""
    landed: str = ""
    """Where the kill landed: during a step, a checkpoint write, or what it missed."""
    trained: dict[int, float] = field(default_factory=dict)
    """Step -> loss of the steps the killed attempt finished."""

    @property
    def steps_lost(self) -> int | None:
        if self.at_step is None or self.resumed_from is None:
            return None
        return self.at_step - self.resumed_from


@dataclass
class Attempt:
    """What rank 0's --metrics-out showed of one attempt (one start of the processes)."""

    first_step: int | None = None
    losses: dict[int, float] = field(default_factory=dict)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plan_layout(name: str, work: Path) -> Path:
    """The output folder of LAYOUTS[name] (planned once, reused)."""
    from autoplan.api import PlanOptions, plan_model

    model, pin = LAYOUTS[name]
    out = work / name / "plan"
    if not (out / "train.py").is_file():
        plan_model(str(MODELS / model), GPUS, PLANNED_FOR,
                   PlanOptions(global_batch=GLOBAL_BATCH, pin=pin, out=out, measure=False))
    return out


def workers(agent: int) -> dict[int, int]:
    """pid -> RANK of the train.py processes below process `agent` (torchrun and whatever it runs through)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # it ended meanwhile
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = {}, [agent]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            todo.append(child)
            try:
                command = (Path("/proc") / str(child) / "cmdline").read_bytes().split(b"\0")
                environ = (Path("/proc") / str(child) / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            rank = next((int(v[5:]) for v in environ if v.startswith(b"RANK=")), None)
            if rank is not None and any(part.endswith(b"train.py") for part in command):
                found[child] = rank
    return found


def read_metrics(path: Path) -> Attempt | None:
    """The attempt rank 0's metrics file shows now (None: not there, or caught mid-write)."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or "steps" not in raw:
        return None
    return Attempt(raw.get("first_step"), {int(e["step"]): e["loss"] for e in raw["steps"]})


class Run:
    """One `bash launch/torchrun.sh` of an output folder, in a session of its own."""

    def __init__(self, out: Path, work: Path, label: str, steps: int, every: int, dropout: bool, restarts: int,
                 timeout_s: float) -> None:
        self.metrics = work / f"{label}.metrics.json"
        self.log = work / f"{label}.log"
        self.metrics.unlink(missing_ok=True)
        self.checkpoints = out / "checkpoints" / label
        shutil.rmtree(self.checkpoints, ignore_errors=True)  # an earlier benchmark's: every run starts at step 0
        from autoplan.runtime.harness.hooks import verify_environment

        env = {**os.environ, "OMP_NUM_THREADS": "1", "RUN_ID": label, "MASTER_PORT": str(free_port()),
               "CHECKPOINT_EVERY": str(every), "MAX_RESTARTS": str(restarts),
               **({} if dropout else verify_environment(None))}
        command = ["bash", str(out / "launch" / "torchrun.sh"), "--device", "cpu", "--steps", str(steps),
                   "--metrics-out", str(self.metrics)]
        self.deadline = time.monotonic() + timeout_s
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(command, cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        self.seen: dict[int, float] = {}
        self.attempts: list[Attempt] = []

    def look(self) -> Attempt | None:
        """Read the metrics; merge what the current attempt trained into the final losses."""
        found = read_metrics(self.metrics)
        if found is not None:
            self.seen.update(found.losses)
        return found

    def alive(self) -> bool:
        if time.monotonic() > self.deadline:
            self.stop()
            raise TimeoutError(f"{self.log.name}: no end within the time limit (see {self.log})")
        return self.process.poll() is None

    def stop(self) -> None:
        if self.process.poll() is None:
            for pid in workers(self.process.pid):
                os.kill(pid, signal.SIGKILL)
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def wait(self) -> int:
        while self.alive():
            self.look()
            time.sleep(0.05)
        self.look()
        return self.process.returncode


def partials(folder: Path) -> dict[str, int]:
    """The .partial checkpoint folders in `folder`, with their modification times (ns)."""
    try:
        return {entry.name: entry.stat().st_mtime_ns for entry in os.scandir(folder) if entry.name.endswith(".partial")}
    except OSError:
        return {}


def partial_checkpoint(folder: Path) -> str:
    """The checkpoint being written ("" if none; runtime/components/checkpoint.py: DIR/.step_<k>.partial/ until rank 0 renames
    it)."""
    try:
        return next((entry.name for entry in os.scandir(folder) if entry.name.endswith(".partial")), "")
    except OSError:
        return ""


def kill_one(run: Run, kill: Kill, steps_ahead: int, writes_passed: int, total_steps: int, delay_s: float) -> None:
    """Wait for the moment `kill` aims at in the current attempt (a step: `steps_ahead` steps after it started, then
    `delay_s` into the next; a checkpoint write: the first .partial folder after `writes_passed` others), SIGKILL its
    rank, and wait for the next attempt to start; record where the kill landed, the steps the attempt had finished
    and where the next resumed."""
    old: dict[int, int] = {}
    writes: set[str] = set()
    stale = partials(run.checkpoints)  # left by an earlier attempt's killed write
    while run.alive() and len(old) < GPUS:
        old = workers(run.process.pid)
        time.sleep(POLL_S)
    start = None
    while run.alive():
        now = run.look()
        if now is not None and now.first_step is not None:
            start = now.first_step if start is None else start
            done = max(now.losses, default=start - 1) + 1
            if kill.kind == "step" and done >= min(start + steps_ahead, total_steps - 1):
                time.sleep(delay_s)
                kill.landed = f"during a step ({done} steps done, +{delay_s * 1e3:.0f} ms)"
                break
            writing = partial_checkpoint(run.checkpoints)
            writes |= {writing} if writing else set()
            if kill.kind == "checkpoint" and writing and len(writes) > writes_passed:
                kill.landed = f"checkpoint write ({writing})"
                break
            if done >= total_steps - 1:  # the last save is near: take what comes
                kill.landed = "missed the checkpoint writes: killed during a step instead"
                break
        time.sleep(POLL_S)
    victim = next((pid for pid, rank in old.items() if rank == kill.rank), None)
    try:
        os.kill(victim, signal.SIGKILL)
    except (ProcessLookupError, TypeError):
        kill.landed = "missed: the rank had ended"
        return
    while run.alive() and set(old) & set(workers(run.process.pid)):  # torchrun stops the other ranks
        time.sleep(POLL_S)
    cut = sorted(name for name, mtime in partials(run.checkpoints).items() if stale.get(name) != mtime)
    if kill.landed.startswith("checkpoint write") and not cut:
        kill.landed = "just after a checkpoint write (it completed first)"
    elif cut and not kill.landed.startswith("checkpoint write"):
        kill.landed += f", inside the checkpoint write it reached ({cut[0]})"
    last = run.look()
    if last is not None:
        kill.trained = dict(last.losses)
        kill.at_step = max(last.losses, default=(last.first_step or 0) - 1) + 1
    run.metrics.unlink(missing_ok=True)  # its ranks are gone: the file that appears next is the next attempt's
    while run.alive():
        now = run.look()
        if now is not None and now.first_step is not None:  # where the next attempt resumed
            kill.resumed_from = now.first_step
            return
        time.sleep(POLL_S)


def run_layout(name: str, args: argparse.Namespace, rng: random.Random) -> list[dict]:
    out = plan_layout(name, args.work)
    rows = []
    for dropout in args.dropout:
        tag = f"{'dropout' if dropout else 'no-dropout'}"
        whole = Run(out, args.work / name, f"whole-{tag}", args.steps, args.checkpoint_every, dropout, 0, args.timeout)
        try:
            whole.wait()
        finally:
            whole.stop()
        if whole.process.returncode != 0:  # the program cannot train this layout: nothing to compare with
            print(f"{name:>15} {tag:>10}: the uninterrupted run failed (exit {whole.process.returncode}): see "
                  f"{whole.log}", flush=True)
            rows.append({"layout": name, "dropout": dropout, "identical": False,
                         "error": f"the uninterrupted run failed (exit {whole.process.returncode})"})
            continue
        reference = [whole.seen[t] for t in range(args.steps)]
        chaos = Run(out, args.work / name, f"chaos-{tag}", args.steps, args.checkpoint_every, dropout, args.kills,
                    args.timeout)
        kills = []
        try:
            for _ in range(args.kills):
                kill = Kill(kind=rng.choice(("step", "checkpoint")), rank=rng.randrange(GPUS))
                kill_one(chaos, kill, rng.randint(1, 2 * args.checkpoint_every), rng.randint(0, 2), args.steps,
                         rng.uniform(0, 0.1))
                kills.append(kill)
                print(f"  {name} {tag}: kill -9 rank {kill.rank} aimed at a {kill.kind}, landed {kill.landed}; "
                      f"{kill.at_step} steps finished, resumed from {kill.resumed_from}: "
                      f"{kill.steps_lost} steps lost", flush=True)
            code = chaos.wait()
        finally:
            chaos.stop()
        replayed = [(step, loss) for k in kills if k.resumed_from is not None
                    for step, loss in k.trained.items() if step >= k.resumed_from]
        final = [chaos.seen.get(t) for t in range(args.steps)]
        identical = code == 0 and final == reference
        diffs = [abs(a - b) for a, b in zip(final, reference) if a is not None]
        replay_equal = all(loss == reference[step] for step, loss in replayed)
        row = {"layout": name, "dropout": dropout, "kills": len(kills), "exit_code": code,
               "steps_lost": [k.steps_lost for k in kills], "landed": [k.landed for k in kills],
               "identical": identical, "max_abs_diff": max(diffs, default=None),
               "missing_steps": sum(v is None for v in final), "replayed_steps_identical": replay_equal}
        rows.append(row)
        print(f"{name:>15} {tag:>10}: {len(kills)} kills, steps lost {row['steps_lost']}, exit {code}, "
              f"final losses {'IDENTICAL' if identical else 'DIFFER'} to the uninterrupted run's "
              f"(max |diff| {row['max_abs_diff']}, {row['missing_steps']} steps missing; steps trained again "
              f"{'identical' if replay_equal else 'differ'})", flush=True)
    return rows


def _interrupted(signum: int, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--kills", type=int, default=3, metavar="N", help="ranks killed per run (default 3)")
    parser.add_argument("--steps", type=int, default=60, help="steps each run trains (default 60)")
    parser.add_argument("--checkpoint-every", type=int, default=10, metavar="K", help="steps between checkpoints")
    parser.add_argument("--dropout", default="on,off", help="on, off or both (default on,off)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=None, help="where the plans, checkpoints and logs go "
                                                                "(default: a new temporary folder)")
    parser.add_argument("--timeout", type=float, default=900.0, metavar="S", help="seconds per run")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    names = [n for n in args.layouts.split(",") if n]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layout(s) {', '.join(unknown)}: choose from {', '.join(LAYOUTS)}")
    modes = {"on": True, "off": False}
    if any(m not in modes for m in args.dropout.split(",")):
        parser.error(f"--dropout takes on, off or on,off, not {args.dropout!r}")
    args.dropout = [modes[m] for m in args.dropout.split(",")]
    if args.kills < 0 or args.checkpoint_every < 1 or args.steps <= args.checkpoint_every:
        parser.error("--kills >= 0, --checkpoint-every >= 1 and --steps > --checkpoint-every")
    if args.work is None:
        import tempfile

        args.work = Path(tempfile.mkdtemp(prefix="autoplan-chaos-"))
    args.work.mkdir(parents=True, exist_ok=True)
    print(f"chaos: {len(names)} layouts x dropout {args.dropout}, {args.kills} kills per run, {args.steps} steps, "
          f"checkpoints every {args.checkpoint_every}, seed {args.seed}; work in {args.work}", flush=True)
    rng = random.Random(args.seed)
    signal.signal(signal.SIGTERM, _interrupted)  # a killed benchmark stops its runs (Run.stop in the finally blocks)
    rows = [row for name in names for row in run_layout(name, args, rng)]
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0 if all(row["identical"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
