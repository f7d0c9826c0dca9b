"""How fast an endpoint serves as a function of how many requests it holds: pure, learned from samples.

A batching engine does not have one service time. Each decode step serves every running sequence
and gets slower as the batch grows, so a stream's time per token at concurrency `c` is about
`t1 * (1 + a * (c - 1))`; past its batch limit (`slots`) requests wait in the engine's FIFO. `Fit` is
that line, fitted by exponentially forgetting least squares over (concurrency, seconds) samples:
  - per-token times from the engine's own counters (two scrapes: running x seconds / tokens), and
    from our answers when they report usage (decode time / completion tokens);
  - per-request decode times from our answers (elapsed minus time to first byte), used when the
    token route is not available (no usage and no token counters).
`Speed` is what the router reads: a typical request's decode time at concurrency one, the slowdown
per extra sequence, the time to first byte and the batch limit, with the arithmetic of expected
completion. Nothing here reads a clock; the caller passes ages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

PRIOR_SLOWDOWN = 0.05  # per extra sequence, assumed until samples at several concurrencies say otherwise
PRIOR_STRENGTH = 2.0  # how many (concurrency^2-weighted) samples that assumption is worth
PRIOR_NOISE = 0.3  # relative scatter of one sample, assumed until the samples show theirs
# A change of speed: CHANGE_RUN samples in a row, on the same side of the line, each off it by more than
# CHANGE_SIGMAS of the samples' scatter and by more than CHANGE_RATIO, once the fit has CHANGE_MIN_WEIGHT
# samples; the fit then restarts from those samples, the history keeping CHANGE_KEEP of its weight.
# Two in a row: one stray sample (a pause, an odd request) is not a change, and weighs STRAY_WEIGHT;
# an engine slowed to 30 % is seen two scrapes after it slowed.
CHANGE_RUN = 2
CHANGE_SIGMAS = 4.0
CHANGE_RATIO = 1.5
CHANGE_MIN_WEIGHT = 4.0
CHANGE_KEEP = 0.02
STRAY_WEIGHT = 0.1  # the weight of a sample far off the line, until the next one says whether it was a change


class Fit(NamedTuple):  # a tuple: one is made for every finished request
    """Least-squares sums of samples y (seconds) at x (concurrency), whose weight halves every
    `half_life` seconds: memory in time, however often samples come."""

    w: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    syy: float = 0.0
    at: float = 0.0  # when the last sample was added (the caller's clock)
    # Samples in a row far off the line on the same side (+ above, - below), and the last of them:
    # two in a row say the engine changed.
    surprises: int = 0
    px: float = 0.0
    py: float = 0.0

    def add(self, x: float, y: float, now: float, half_life: float) -> "Fit":
        f = 0.5 ** (max(0.0, now - self.at) / half_life) if self.w else 0.0
        run = self._surprise(x, y)
        k = 1.0
        if abs(run) >= CHANGE_RUN:
            # An engine that slowed down (throttling, a noisy neighbour) or recovered: what was
            # learned before describes another engine. Start again from the samples that showed
            # the change, keeping a trace of the old ones.
            f *= CHANGE_KEEP
            old = Fit(self.w * f, self.sx * f, self.sy * f, self.sxx * f, self.sxy * f, self.syy * f, now)
            return old._plus(self.px, self.py, 1.0)._plus(x, y, 1.0)
        if run:
            k = STRAY_WEIGHT  # maybe the first sign of a change, maybe a stray: it weighs little for now
        return Fit(self.w * f + k, self.sx * f + k * x, self.sy * f + k * y, self.sxx * f + k * x * x,
                   self.sxy * f + k * x * y, self.syy * f + k * y * y, now, run, x, y)

    def _plus(self, x: float, y: float, k: float) -> "Fit":
        return Fit(self.w + k, self.sx + k * x, self.sy + k * y, self.sxx + k * x * x, self.sxy + k * x * y,
                   self.syy + k * y * y, self.at)

    def _surprise(self, x: float, y: float) -> int:
        """The run of surprises with this sample: it is one when it is more than CHANGE_SIGMAS of the
        samples' own scatter (and CHANGE_RATIO) away from the fitted line, after enough samples."""
        if self.w < CHANGE_MIN_WEIGHT or (line := self.line()) is None:
            return 0
        y1, a = line
        pred = y1 * (1.0 + a * max(0.0, x - 1.0))
        sd = math.sqrt(self._resid() / self.w)
        off = y - pred
        if abs(off) <= max(CHANGE_SIGMAS * sd, (CHANGE_RATIO - 1.0) * pred):
            return 0
        side = 1 if off > 0 else -1
        return self.surprises + side if self.surprises * side > 0 else side

    def _resid(self) -> float:
        """The weighted sum of squared residuals around the least-squares line (w > 0)."""
        mx, my = self.sx / self.w, self.sy / self.w
        sxx = max(0.0, self.sxx - self.sx * mx)
        sxy = self.sxy - self.sx * my
        return max(0.0, self.syy - self.sy * my - (sxy * sxy / sxx if sxx > 0 else 0.0))

    def error(self) -> float:
        """Relative standard error of the fitted level: the samples' scatter around the line over
        the square root of their weight. The scatter starts from a prior of PRIOR_NOISE per sample
        worth two samples, so a few samples that happen to agree are not taken for certainty."""
        if self.w <= 0 or self.sy <= 0:
            return 1.0
        my = self.sy / self.w
        scatter = (self._resid() + 2 * (PRIOR_NOISE * my) ** 2) / (self.w + 1)
        return math.sqrt(scatter / self.w) / my

    def line(self) -> tuple[float, float] | None:
        """(y at concurrency one, fractional slowdown per extra sequence), or None without samples.

        The slope is shrunk toward PRIOR_SLOWDOWN (ridge): samples that all sit at one concurrency
        say nothing about the slope, and then the level is read as if that slowdown held."""
        if self.w <= 0:
            return None
        mx, my = self.sx / self.w, self.sy / self.w
        if my <= 0:
            return None
        prior = PRIOR_SLOWDOWN * my / (1 + PRIOR_SLOWDOWN * max(0.0, mx - 1))  # slope of the prior line
        sxx = max(0.0, self.sxx - self.sx * mx)
        sxy = self.sxy - self.sx * my
        slope = (sxy + PRIOR_STRENGTH * prior) / (sxx + PRIOR_STRENGTH)
        y1 = my - slope * (mx - 1)
        if slope < 0 or y1 <= 0.1 * my:  # noise: keep the level, take the prior's shape
            slope = prior
            y1 = my - slope * (mx - 1)
        return y1, slope / y1


def shrink(estimates: "list[tuple[Speed, float]]") -> "list[Speed]":
    """Endpoints of one model, each with the relative error of its estimate, pulled toward their
    common speed as far as the data cannot tell them apart (empirical Bayes on log decode times).
    Identical engines then look identical instead of differing by their sampling noise, which would
    steer traffic by chance; engines that truly differ keep their own speeds."""
    if len(estimates) < 2:
        return [sp for sp, _ in estimates]
    xs = [math.log(sp.decode1) for sp, _ in estimates]
    vs = [max(err, 1e-3) ** 2 for _, err in estimates]
    ws = [1 / v for v in vs]
    mean = sum(w * x for w, x in zip(ws, xs)) / sum(ws)
    slow = sum(w * sp.slowdown for w, (sp, _) in zip(ws, estimates)) / sum(ws)
    spread = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1) - sum(vs) / len(vs)  # true differences
    out = []
    for (sp, _), x, v in zip(estimates, xs, vs):
        keep = max(0.0, spread) / (max(0.0, spread) + v)  # 0: all noise, 1: all signal
        d1 = math.exp(mean + keep * (x - mean))
        out.append(Speed(d1, slow + keep * (sp.slowdown - slow), sp.ttfb, sp.per_token * d1 / sp.decode1))
    return out


@dataclass(frozen=True)
class Speed:
    """An endpoint's learned speed, in seconds for a typical request (see the module docstring)."""

    decode1: float  # decode time of a typical request alone on the endpoint
    slowdown: float  # fractional increase of that time per extra running sequence
    ttfb: float = 0.0  # time to first byte when a slot is free (network, first step; prefill of prompts routed without keys)
    # Seconds per output token after the first at concurrency one (what a stream's TPOT is alone); 0:
    # not known (no answer or scrape said how many tokens the answers had).
    per_token: float = 0.0

    def decode(self, c: float) -> float:
        return self.decode1 * (1.0 + self.slowdown * max(0.0, c - 1.0))

    def completion(self, held: float, slots: float) -> float:
        """Seconds until a request sent now completes, when the endpoint already holds `held`: it
        runs in a batch of min(held + 1, slots), after waiting for held + 1 - slots of the requests
        ahead to finish (a full endpoint finishes `slots` requests per full-batch decode time)."""
        d1, a = self.decode1, self.slowdown
        if held + 1.0 <= slots:
            return self.ttfb + d1 * (1.0 + a * held)  # decode(held + 1), inline: once per endpoint per request
        full = d1 * (1.0 + a * (slots - 1.0))
        return self.ttfb + (held + 1.0 - slots) * full / slots + full

    def first_token(self, held: float, slots: float) -> float:
        """Seconds until the first token of a request sent now: its time to first byte once a slot
        is free, after the wait for one when the batch is full (as in `completion`)."""
        if held + 1.0 <= slots:
            return self.ttfb
        full = self.decode1 * (1.0 + self.slowdown * (slots - 1.0))
        return self.ttfb + (held + 1.0 - slots) * full / slots

    def tpot(self, held: float, slots: float) -> float:
        """Seconds per token of a request sent now, in the batch it joins (min(held + 1, slots)); 0
        when the tokens per answer are not known."""
        return self.per_token * (1.0 + self.slowdown * (min(held + 1.0, slots) - 1.0))

    def imposed(self, held: float, slots: float) -> float:
        """Seconds the request adds to the others' completions: joining a batch of `held` running
        slows each of them by one step's increment for about half of what they have left. Joining
        the engine's queue delays nobody ahead of it."""
        if held + 1.0 > slots:
            return 0.0
        return held * self.decode1 * self.slowdown * 0.5

    def rate(self, slots: float) -> float:
        """Requests per second the endpoint completes with a full batch."""
        if math.isinf(slots):
            return math.inf
        return slots / self.decode(slots)

    def relaxed_toward(self, best: "Speed", keep: float) -> "Speed":
        """This speed moved toward `best` by 1 - keep (an old slow estimate is given another chance)."""
        if self.decode1 <= best.decode1:
            return self
        d1 = best.decode1 + (self.decode1 - best.decode1) * keep
        return Speed(d1, self.slowdown, self.ttfb, self.per_token * d1 / self.decode1)
