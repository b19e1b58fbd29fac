"""The optimisation loop of ``dartree train-drafter``: the lr and lambda schedules, the steps (a row
whose loss or gradient is not finite is skipped), the logs, the periodic checkpoint + export (and the
resume from it), and the held-out estimates."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from services.drafter.model import DFlashDrafter, save_drafter
from services.training.train_data import HELDOUT_SHARD, DataStream
from services.training.train_loss import Trainer


@dataclass(frozen=True)
class Schedule:
    """Learning-rate and lambda schedules as pure functions of the step (saved in ``ckpt.pt``).

    lr: linear warm-up over ``warmup`` steps to ``lr``, then cosine to 10 % of it at ``steps``
    (flat after). lambda (weight of the base loss): linear ``lambda_start`` -> ``lambda_end`` over
    ``steps`` (flat after). ``steps`` is ``--schedule-steps``, independent of where a run stops.
    """

    lr: float
    warmup: int
    steps: int
    lambda_start: float
    lambda_end: float

    def lr_at(self, s: int) -> float:
        """Learning rate of optimiser step ``s`` (0-based)."""
        if s < self.warmup:
            return self.lr * (s + 1) / self.warmup
        frac = min(1.0, (s - self.warmup) / max(1, self.steps - self.warmup))
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    def lambda_at(self, s: int) -> float:
        """Base-loss weight lambda of step ``s``."""
        return self.lambda_start + (self.lambda_end - self.lambda_start) * min(1.0, s / max(1, self.steps))


class TrainLoop:
    """One run's optimisation state and its loop: step, RNG, clocks, skipped rows, loss EMAs, and the
    ``<work-dir>/ckpt.pt`` + ``--out`` export written every ``--save-every-min`` and at the end.

    Args:
        a: the parsed ``train-drafter`` flags.
        drafter: the drafter being trained (its weights change in place).
        opt: its optimiser (:func:`services.training.train_init.make_optimiser`).
        sched: the schedules of a fresh run (a resume replaces them with the checkpoint's).
        origin: where the starting weights came from (saved in the checkpoint and the export).
    """

    def __init__(self, a, drafter: DFlashDrafter, opt: torch.optim.Optimizer, sched: Schedule, origin: dict):
        self.a, self.drafter, self.opt, self.sched, self.origin = a, drafter, opt, sched, origin
        self.rng = random.Random(a.seed)
        self.work = Path(a.work_dir)
        self.ckpt = self.work / "ckpt.pt"
        self.step, self.elapsed_prev, self.cpu_prev = 0, 0.0, 0.0  # trained before this process: s, CPU s
        self.data_state: dict | None = None  # the resumed DataStream position
        self.stream: DataStream | None = None
        self.skipped = 0
        self.ema: dict[str, float] = {}
        self._t0, self._cpu0 = time.time(), time.process_time()

    def resume(self, st: dict, embed_w: torch.Tensor, head_w: torch.Tensor) -> None:
        """Continue the checkpoint ``st`` exactly: weights (a DSpark drafter's frozen copies of the
        target's ``embed_w`` / ``head_w [V, H]`` put back), optimiser, step, clocks, RNGs, data position
        and schedule."""
        d = self.drafter
        d.load_state_dict(st["model"])
        if d.has_markov:
            d.copy_target_io(embed_w, head_w)  # frozen (requires_grad off) after the load
        self.opt.load_state_dict(st["opt"])
        self.step, self.elapsed_prev, self.cpu_prev = st["step"], st.get("elapsed", 0.0), st.get("cpu_elapsed", 0.0)
        self.rng.setstate(st["rng"])
        if "torch_rng" in st:
            torch.set_rng_state(st["torch_rng"])
        self.data_state = st.get("data")
        if "schedule" in st:  # (a different --schedule-steps was refused by preflight)
            self.sched = Schedule(**st["schedule"])
        print(f"[train] resumed at step {self.step} ({self.elapsed_prev / 60:.1f} min trained); schedule "
              f"{self.sched}", flush=True)

    def elapsed(self) -> float:
        """Wall seconds trained, earlier processes included (any kill -STOP pause counts too)."""
        return self.elapsed_prev + time.time() - self._t0

    def run(self, trainer: Trainer, stream: DataStream, heldout: list[dict], target=None,
            turns: list | None = None) -> None:
        """Train from ``stream`` until ``--max-steps`` or ``--max-minutes``, evaluating (:func:`evaluate`)
        at the start of a fresh run, every ``--eval-every`` steps and at the end; saves at the end.

        Raises:
            RuntimeError: too many rows gave a non-finite loss or gradient, or the weights turned
                non-finite (nothing is saved over the last good checkpoint).
        """
        a = self.a
        self.stream = stream
        self._t0, last_save, self._cpu0 = time.time(), time.time(), time.process_time()
        bar = tqdm(total=a.max_steps, initial=self.step, desc="train", mininterval=30)

        def estimate() -> None:
            evaluate(trainer, heldout, self.work, self.step, target, turns, a.replay_budgets)

        if self.step == 0 and a.eval_every:  # the starting point of the held-out curve (e.g. the --init-from export)
            estimate()
        with open(self.work / "train_log.jsonl", "a") as log:
            while self.step < a.max_steps and not (a.max_minutes and self.elapsed() / 60 >= a.max_minutes):
                if not self._train_step(trainer, log):
                    continue
                bar.update(1)
                bar.set_postfix({k: f"{v:.3f}" for k, v in self.ema.items()}, refresh=False)
                if a.eval_every and self.step % a.eval_every == 0:
                    estimate()
                if time.time() - last_save > a.save_every_min * 60:
                    self.save()
                    last_save = time.time()
        self.save(final=True)
        estimate()
        print(f"[train] stopped at step {self.step} of {self.sched.steps} (schedule); drafter exported to {a.out}",
              flush=True)

    def _train_step(self, trainer: Trainer, log) -> bool:
        """One row: an optimiser step (True), or none (False: no anchor, or a skipped non-finite row)."""
        row = self.stream.next()
        lam, lr = self.sched.lambda_at(self.step), self.sched.lr_at(self.step)
        out = trainer.loss(row, lam, self.rng)
        if out is None:
            return False
        loss, stats = out
        for g in self.opt.param_groups:
            g["lr"] = lr * g.get("lr_mult", 1.0)
        self.opt.zero_grad(set_to_none=True)
        bad = "loss" if not torch.isfinite(loss) else None
        if bad is None:
            loss.backward()
            if not torch.isfinite(torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), 1.0)):
                bad = "gradient norm"
        if bad:  # one bad row must not turn every weight into NaN (it once cost a whole run): skip it
            self._skip(bad, log)
            return False
        self.opt.step()
        self.step += 1
        self._log(stats, lr, lam, log)
        return True

    def _skip(self, bad: str, log) -> None:
        """Drop the row whose ``bad`` ("loss" / "gradient norm") was not finite; too many stop the run."""
        self.opt.zero_grad(set_to_none=True)
        self.skipped += 1
        print(f"[train] step {self.step}: non-finite {bad} on {self.stream.last()}: row skipped ({self.skipped} "
              "so far)", flush=True)
        log.write(json.dumps({"step": self.step, "skipped": self.stream.last(), "why": f"non-finite {bad}"}) + "\n")
        if self.skipped > max(100, self.step // 100):
            raise RuntimeError(f"{self.skipped} rows gave a non-finite {bad} by step {self.step}: stopping (the last "
                               f"checkpoint is the last good state)")

    def _log(self, stats: dict[str, float], lr: float, lam: float, log) -> None:
        """Update the loss EMAs; every ``--log-every`` steps append a line to ``train_log.jsonl``."""
        for k, v in stats.items():
            self.ema[k] = v if k not in self.ema else 0.98 * self.ema[k] + 0.02 * v
        if self.a.log_every and self.step % self.a.log_every == 0:
            log.write(json.dumps({"step": self.step, "lr": lr, "lambda": lam,
                                  **{k: round(v, 5) for k, v in stats.items()},
                                  **{f"ema_{k}": round(v, 4) for k, v in self.ema.items()}}) + "\n")
            log.flush()

    def save(self, final: bool = False) -> None:
        """Write ``ckpt.pt`` (atomically) and the ``--out`` export.

        Raises:
            RuntimeError: a weight is not finite (the last good checkpoint and export are kept).
        """
        d, a, step = self.drafter, self.a, self.step
        bad = [n for n, w in d.named_parameters() if not bool(torch.isfinite(w).all())]
        if bad:  # never overwrite the last good checkpoint and export with a broken model
            raise RuntimeError(f"non-finite weights at step {step} ({', '.join(bad[:3])}): checkpoint and "
                               f"export not written (the last good ones are kept in {self.ckpt} and {a.out})")
        elapsed = self.elapsed()
        cpu = self.cpu_prev + time.process_time() - self._cpu0  # CPU time of this process (all threads)
        torch.save({"model": d.state_dict(), "opt": self.opt.state_dict(), "step": step, "rng": self.rng.getstate(),
                    "torch_rng": torch.get_rng_state(), "elapsed": elapsed, "cpu_elapsed": cpu,
                    "schedule": dataclasses.asdict(self.sched), "data": self.stream.state(),
                    "drafter_config": d.config.to_hf(), "origin": self.origin}, self.work / "ckpt.tmp")
        (self.work / "ckpt.tmp").rename(self.ckpt)
        save_drafter(d, a.out, omit_target_copies=d.has_markov,
                     extra={"training": {"steps": step, "schedule_steps": self.sched.steps,
                                         "minutes": round(elapsed / 60, 1), "cpu_minutes": round(cpu / 60, 1),
                                         "final": final, **self.origin}})


def load_heldout(a, target, tpath: Path, work: Path) -> tuple[list[dict], list]:
    """``(held-out sequences, replay turns)``: the first ``--heldout`` rows of the held-out shard (none
    while it is not generated yet: replayed tau only) and :func:`heldout_turns`."""
    hpath = Path(a.feat_dir) / f"{HELDOUT_SHARD}.pt"
    heldout = torch.load(hpath)[: a.heldout] if hpath.exists() else []
    return heldout, heldout_turns(a, target, tpath, work)


def heldout_turns(a, target, tpath: Path, work: Path) -> list:
    """Held-out prompts and the target's greedy outputs for the replayed tau (cached in the work dir)."""
    from services.training.heldout import greedy_turns, heldout_prompt_ids, load_prompt_file

    if not a.replay_prompts and not a.replay_prompt_file:
        return []
    prompts = (load_prompt_file(Path(a.replay_prompt_file)) if a.replay_prompt_file
               else heldout_prompt_ids(tpath, a.replay_prompts))
    t0 = time.time()
    turns = greedy_turns(target, prompts, a.replay_max_tokens, work / "heldout_turns.pt")
    print(f"[train] held-out replay: {len(turns)} prompts x <= {a.replay_max_tokens} greedy tokens "
          f"({time.time() - t0:.0f} s)", flush=True)
    return turns


@torch.no_grad()
def evaluate(trainer: Trainer, heldout: list[dict], work: Path, step: int, target=None, turns: list | None = None,
             budgets: tuple[int, ...] = (8, 64)) -> dict:
    """Held-out estimates, appended to ``<work>/eval.jsonl``: the engine's replayed dartree-pruned tau
    (ddtree without a Domino head) on held-out prompts at each budget B (W = 12; ``replay_tau_B<B>``;
    the figure to trust), and the
    teacher-forced chain acceptance on held-out on-policy sequences (base and Domino-corrected)."""
    rng = random.Random(1234)
    acc: dict[str, list[float]] = {}
    trainer.m.eval()
    for row in heldout:
        out = trainer.loss(row, 0.5, rng)
        if out is not None:
            for k, v in out[1].items():
                acc.setdefault(k, []).append(v)
    trainer.m.train()
    res = {k: sum(v) / len(v) for k, v in acc.items()}
    if turns:
        from services.training.heldout import replayed_tau

        t0 = time.time()
        method = "dspark-dartree" if trainer.m.has_markov else "dartree-pruned" if trainer.m.has_head else "ddtree"
        for b in budgets:
            res[f"replay_tau_B{b}"] = replayed_tau(trainer.m, target, turns, method, budget=b)
        res["replay_s"] = time.time() - t0
    line = json.dumps({"step": step, **{k: round(v, 4) for k, v in res.items()}})
    print(f"[eval] {line}", flush=True)
    with open(work / "eval.jsonl", "a") as f:
        f.write(line + "\n")
    return res
