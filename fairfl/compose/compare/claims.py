"""Claims as data: what a comparison file says one run does better than another, tested over seeds.

A claim names a run, a metric, a direction and a baseline run, and optionally a margin::

    claims:
      - claim: FedEBA+ lowers the variance of client accuracy below FedAvg's
        run: FedEBA+
        metric: variance
        is: lower            # lower | higher
        than: FedAvg
      - claim: FedEBA+ keeps FedAvg's mean accuracy, within 0.5 points
        run: FedEBA+
        metric: mean
        is: higher
        than: FedAvg
        margin: -0.5         # FedEBA+ mean > FedAvg mean - 0.5
      - claim: Equitable-FL's clusters recover the true groups
        run: Equitable-FL
        metric: nmi_all_groups
        is: higher
        than: 0.9            # a number: a threshold, not a run
      - claim: HiCS-FL reaches 75% at least twice as fast as random
        run: HiCS-FL
        metric: rounds_to_target
        is: lower
        than: random
        factor: 2            # HiCS-FL rounds < random rounds / 2: tested on the log scale

With d = run − baseline − margin per seed (baseline: the other run's value, or the number), "lower" is the one-sided
alternative mean(d) < 0 ("higher": > 0). The test is a paired t-test over the seeds both runs have when those seeds
share their data partition (same seed, same `data` config), else Welch's t-test over each run's own seeds; against a
number, a one-sample t-test. When every seed gives the same difference there is no spread to test against and the
exact sign test decides (0.5^n). A claim holds when p < alpha (default 0.05) and every seed the comparison planned for
its runs has a value (else it is incomplete). The report gives the mean difference run − baseline with its two-sided
1 − 2·alpha interval (90% at alpha 0.05: its end on the claimed side is the test's bound, so the claim holds exactly
when that end lies beyond the margin), p, and for paired tests how many seeds point the claimed way. For
`rounds_to_target` a seed that never reached the target counts as its final round + 1: the fewest rounds it could
have taken, which is fair to the side the claim calls slower. A seed where the side it calls faster missed the target
and the other side reached it makes the claim not held (its rounds are unknown there); a seed where neither reached
it counts as no difference.

With `factor: F` instead of a margin the claim is a ratio: "lower" means run < baseline / F, "higher" run > baseline ×
F. The same tests then run on the logs of the values (d = ln run − ln baseline ∓ ln F), which fits quantities that
scale, like rounds to a target or a variance; the report gives the geometric-mean ratio run / baseline with its
interval. Every value must be positive.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fairfl.compose.compare.metrics import SEED_METRICS
from fairfl.config import ConfigError
from fairfl.schema import expect_mapping

if TYPE_CHECKING:
    from fairfl.compose.compare.summary import SeedSummary

DIRECTIONS = ("lower", "higher")
_CLAIM_KEYS = ("claim", "run", "metric", "is", "than", "margin", "factor", "alpha")
DEFAULT_ALPHA = 0.05
CI_LEVEL = 0.95


@dataclass(frozen=True)
class Claim:
    """`run`'s `metric` is `direction` than `than`'s (a run label) or than `than` (a number), + margin, significant at
    `alpha`."""

    text: str
    run: str
    metric: str
    direction: str
    than: str | float
    margin: float = 0.0
    alpha: float = DEFAULT_ALPHA
    factor: float | None = None  # a ratio claim: run < baseline / factor ("lower"), run > baseline × factor

    @property
    def log_margin(self) -> float:
        """The margin the test applies to d: `margin`, or ∓ln(factor) on the log scale of a ratio claim."""
        if self.factor is None:
            return self.margin
        return (-1.0 if self.direction == "lower" else 1.0) * math.log(self.factor)

    @property
    def ci_level(self) -> float:
        """The two-sided interval whose end on the claimed side is the one-sided test's bound: 1 − 2·alpha (90% at
        alpha 0.05), so the claim holds exactly when that end lies beyond the margin."""
        return 1 - 2 * self.alpha

    def statement(self) -> str:
        """The claim as a formula, e.g. `FedEBA+ variance < FedAvg variance − 0.5`."""
        sign = "<" if self.direction == "lower" else ">"
        if self.factor is not None:
            margin = f" {'/' if self.direction == 'lower' else '×'} {self.factor:g}"
        else:
            margin = "" if self.margin == 0 else f" {'+' if self.margin > 0 else '−'} {abs(self.margin):g}"
        baseline = f"{self.than:g}" if self.threshold else f"{self.than} {self.metric}"
        return f"{self.run} {self.metric} {sign} {baseline}{margin}"

    @property
    def threshold(self) -> bool:
        """Whether `than` is a number (a one-sample claim) rather than a run label."""
        return not isinstance(self.than, str)


@dataclass(frozen=True)
class ClaimResult:
    claim: Claim
    held: bool
    verdict: str  # one line a reader can act on: why it holds, or why not
    test: str  # "paired t-test", "Welch t-test", "one-sample t-test", "sign test", or "" when untestable
    n: int  # paired: common seeds; Welch: the smaller side
    difference: float | None  # mean of run − baseline (without the margin); a ratio claim: geometric-mean ratio
    ci: tuple[float, float] | None  # the claim's ci_level interval of that difference (or ratio)
    p_value: float | None
    agreeing_seeds: int | None = None  # paired: seeds whose difference points the claimed way
    censored: int = 0  # seeds counted at final round + 1 (rounds_to_target only)

    def as_dict(self) -> dict[str, Any]:
        c = self.claim
        return {
            "claim": c.text,
            "statement": c.statement(),
            "run": c.run,
            "metric": c.metric,
            "is": c.direction,
            "than": c.than,
            "margin": c.margin,
            "factor": c.factor,
            "scale": "ratio" if c.factor is not None else "difference",
            "alpha": c.alpha,
            "held": self.held,
            "verdict": self.verdict,
            "test": self.test,
            "n": self.n,
            "difference": self.difference,
            "ci": list(self.ci) if self.ci else None,
            "ci_level": c.ci_level,
            "p_value": self.p_value,
            "agreeing_seeds": self.agreeing_seeds,
            "censored_seeds": self.censored,
        }


def parse_claims(value: Any, labels: Sequence[str], target_accuracy: float | None) -> list[Claim]:
    """The comparison file's `claims:` list, validated against its run labels and the reportable metrics."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError("claims: expected a list of claims, each with claim, run, metric, is and than")
    return [_claim(raw, f"claims[{i}]", labels, target_accuracy) for i, raw in enumerate(value)]


def _claim(raw: Any, path: str, labels: Sequence[str], target_accuracy: float | None) -> Claim:
    raw = expect_mapping(raw, _CLAIM_KEYS, path)
    for key in ("run", "metric", "is", "than"):
        if key not in raw:
            raise ConfigError(f"{path}.{key}: required field is missing")
    threshold = isinstance(raw["than"], int | float) and not isinstance(raw["than"], bool)
    for key in ("run",) if threshold else ("run", "than"):
        if raw[key] not in labels:
            what = "a run label" if key == "run" else "a run label or a number"
            raise ConfigError(f"{path}.{key}: {raw[key]!r} is not {what}; labels: {', '.join(labels)}")
    if threshold and not math.isfinite(raw["than"]):
        raise ConfigError(f"{path}.than: expected a run label or a finite number, got {raw['than']!r}")
    if raw["run"] == raw["than"]:
        raise ConfigError(f"{path}.than: a claim compares two different runs, got {raw['run']!r} twice")
    metric = raw["metric"]
    if metric not in SEED_METRICS:
        raise ConfigError(f"{path}.metric: unknown metric {metric!r}; valid metrics: {', '.join(SEED_METRICS)}")
    if metric == "rounds_to_target" and target_accuracy is None:
        raise ConfigError(f"{path}.metric: rounds_to_target needs target_accuracy in the comparison file")
    if raw["is"] not in DIRECTIONS:
        raise ConfigError(f"{path}.is: expected one of {', '.join(DIRECTIONS)}, got {raw['is']!r}")
    margin = _finite(raw.get("margin", 0.0), f"{path}.margin")
    factor = None if raw.get("factor") is None else _finite(raw["factor"], f"{path}.factor")
    if factor is not None and factor <= 0:
        raise ConfigError(f"{path}.factor: expected a ratio > 0, e.g. 2 for 'at least twice', got {raw['factor']!r}")
    if factor is not None and "margin" in raw:
        raise ConfigError(f"{path}: give margin (a difference) or factor (a ratio), not both")
    if factor is not None and isinstance(raw["than"], int | float) and raw["than"] <= 0:
        raise ConfigError(f"{path}.than: a ratio claim needs a positive threshold, got {raw['than']!r}")
    alpha = _finite(raw.get("alpha", DEFAULT_ALPHA), f"{path}.alpha")
    if not 0 < alpha < 0.5:
        raise ConfigError(f"{path}.alpha: expected a significance level in (0, 0.5), e.g. 0.05, got {alpha!r}")
    text = raw.get("claim")
    if text is not None and (not isinstance(text, str) or not text.strip()):
        raise ConfigError(f"{path}.claim: expected the claim in words, got {text!r}")
    than = float(raw["than"]) if threshold else raw["than"]
    claim = Claim("", raw["run"], metric, raw["is"], than, margin, alpha, factor)
    return dataclasses.replace(claim, text=text or claim.statement())


def _finite(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{path}: expected a finite number, got {value!r}")
    return float(value)


def seed_value(run: SeedSummary, metric: str) -> tuple[float | None, bool]:
    """One seed's value of `metric` and whether it is censored (target never reached: final round + 1)."""
    if metric == "wall_seconds":
        value: float | None = run.wall_seconds
    elif metric in run.final_fairness:
        value = run.final_fairness[metric]
    else:
        value = run.extra.get(metric)
    if metric == "rounds_to_target" and value is None and "rounds_to_target" in run.extra:
        return float(run.final_round + 1), True
    if value is None or not math.isfinite(float(value)):
        return None, False
    return float(value), False


def evaluate_claim(
    claim: Claim,
    runs: Sequence[SeedSummary],
    shares_partition: Callable[[int], bool],
    planned: dict[str, int] | None = None,
) -> ClaimResult:
    """Test one claim over the finished runs. `shares_partition(seed)`: whether both runs' seed `seed` trained on the
    same data partition (then the seeds pair up). `planned`: seeds each run label should have; with fewer, the claim
    is not held yet (incomplete), whatever the partial test says."""
    mine = _values(claim.run, claim.metric, runs)
    sides = [(claim.run, mine)]
    if isinstance(claim.than, str):
        sides.append((claim.than, _values(claim.than, claim.metric, runs)))
    result = _nonpositive_refusal(claim, sides) if claim.factor is not None else None
    if result is None:
        result = (
            _ratio_test(claim, sides, shares_partition)
            if claim.factor is not None
            else _run_test(claim, sides, shares_partition)
        )
    missing = [
        f"{label} has {len(values)} of {planned[label]} seeds"
        for label, values in sides
        if planned and len(values) < planned.get(label, 0)
    ]
    if missing and result.held:
        result = dataclasses.replace(result, held=False, verdict=f"incomplete ({'; '.join(missing)}): {result.verdict}")
    elif missing:
        result = dataclasses.replace(result, verdict=f"{result.verdict}; incomplete ({'; '.join(missing)})")
    return result


def _run_test(
    claim: Claim, sides: list[tuple[str, dict[int, tuple[float, bool]]]], shares_partition: Callable[[int], bool]
) -> ClaimResult:
    mine = sides[0][1]
    if isinstance(claim.than, str):
        return _test(claim, mine, sides[1][1], shares_partition)
    return _censoring_refusal(claim, mine, {}, None) or _threshold_test(claim, mine, claim.than)


def _ratio_test(
    claim: Claim, sides: list[tuple[str, dict[int, tuple[float, bool]]]], shares_partition: Callable[[int], bool]
) -> ClaimResult:
    """The difference test on the logs (margin ∓ln factor), its difference and interval mapped back to a ratio."""
    than = claim.than if isinstance(claim.than, str) else math.log(claim.than)
    on_logs = dataclasses.replace(claim, than=than, margin=claim.log_margin)
    logs = [(label, {s: (math.log(v), c) for s, (v, c) in values.items()}) for label, values in sides]
    result = _run_test(on_logs, logs, shares_partition)
    ratio = None if result.difference is None else math.exp(result.difference)
    ci = None if result.ci is None else (math.exp(result.ci[0]), math.exp(result.ci[1]))
    return dataclasses.replace(result, claim=claim, difference=ratio, ci=ci)


def _nonpositive_refusal(claim: Claim, sides: list[tuple[str, dict[int, tuple[float, bool]]]]) -> ClaimResult | None:
    for label, values in sides:
        for seed, (value, _) in sorted(values.items()):
            if value <= 0:
                verdict = (
                    f"not held: not testable as a ratio, {label} seed {seed} has {claim.metric} = {value:g} "
                    "(a factor claim needs positive values; use a margin)"
                )
                return ClaimResult(claim, False, verdict, "", len(values), None, None, None)
    return None


def _test(
    claim: Claim,
    mine: dict[int, tuple[float, bool]],
    theirs: dict[int, tuple[float, bool]],
    shares_partition: Callable[[int], bool],
) -> ClaimResult:
    censored = sum(c for _, c in mine.values()) + sum(c for _, c in theirs.values())
    common = sorted(set(mine) & set(theirs))
    paired = len(common) >= 2 and all(shares_partition(s) for s in common)
    refusal = _censoring_refusal(claim, mine, theirs, common if paired else None)
    if refusal is not None:
        return refusal
    if paired:
        diffs = [mine[s][0] - theirs[s][0] for s in common]
        return _paired(claim, diffs, censored)
    return _welch(claim, [v for v, _ in mine.values()], [v for v, _ in theirs.values()], censored)


def _threshold_test(claim: Claim, mine: dict[int, tuple[float, bool]], threshold: float) -> ClaimResult:
    censored = sum(c for _, c in mine.values())
    if len(mine) < 2:
        verdict = f"not held: not testable, needs 2 seeds of {claim.run} with a value, has {len(mine)}"
        return ClaimResult(claim, False, verdict, "", len(mine), None, None, None, None, censored)
    return _paired(claim, [v - threshold for v, _ in mine.values()], censored, "one-sample t-test")


def _censoring_refusal(
    claim: Claim,
    mine: dict[int, tuple[float, bool]],
    theirs: dict[int, tuple[float, bool]],
    pairs: list[int] | None,
) -> ClaimResult | None:
    """A seed that never reached the target counts at final round + 1, the fewest rounds it could have taken: fair to
    the side the claim says is slower, but on the side it says is faster it would flatter the claim. Refuse that: in a
    paired test, a seed where the faster side missed the target and the slower side reached it (a seed where neither
    did counts as no difference); otherwise, any miss of the faster side."""
    lower = claim.direction == "lower"
    faster, fast, slow = (claim.run, mine, theirs) if lower else (str(claim.than), theirs, mine)
    if pairs is not None:
        flattering = [s for s in pairs if fast[s][1] and not slow[s][1]]
    else:
        flattering = [s for s, (_, censored) in fast.items() if censored]
    if not flattering:
        return None
    seeds = ", ".join(map(str, flattering))
    verdict = f"not held: {faster} never reached the target in seed(s) {seeds}, so its rounds to the target are unknown"
    if pairs is not None:
        verdict += " where the other side reached it"
    return ClaimResult(claim, False, verdict, "", len(pairs or fast), None, None, None, None, len(flattering))


def _values(label: str, metric: str, runs: Sequence[SeedSummary]) -> dict[int, tuple[float, bool]]:
    out = {}
    for r in runs:
        if r.label == label:
            value, censored = seed_value(r, metric)
            if value is not None:
                out[r.seed] = (value, censored)
    return out


def t_interval(mean: float, se: float, dof: float, level: float) -> tuple[float, float]:
    """The two-sided `level` t-interval around `mean` with standard error `se`."""
    from scipy import stats

    half = float(stats.t.ppf(0.5 + level / 2, dof)) * se if se > 0 else 0.0
    return (mean - half, mean + half)


def _one_sided_p(claim: Claim, shifted_mean: float, se: float, dof: float) -> float:
    """P(T ≤ t) for "lower", P(T ≥ t) for "higher", t = (mean difference − margin) / se."""
    from scipy import stats

    sign = -1.0 if claim.direction == "lower" else 1.0
    return float(stats.t.cdf(sign * -shifted_mean / se, dof))


def _paired(claim: Claim, diffs: list[float], censored: int, test: str = "paired t-test") -> ClaimResult:
    n = len(diffs)
    mean, sd = statistics.fmean(diffs), statistics.stdev(diffs)
    sign = -1.0 if claim.direction == "lower" else 1.0
    agreeing = sum(1 for d in diffs if sign * (d - claim.margin) > 0)
    se = sd / math.sqrt(n)
    ci = t_interval(mean, se, n - 1, claim.ci_level)
    if _no_spread(se, mean):
        return _result(claim, "sign test", n, mean, ci, _sign_test(agreeing, n), agreeing, censored)
    return _result(claim, test, n, mean, ci, _one_sided_p(claim, mean - claim.margin, se, n - 1), agreeing, censored)


def _welch(claim: Claim, mine: list[float], theirs: list[float], censored: int) -> ClaimResult:
    n = min(len(mine), len(theirs))
    if n < 2:
        verdict = f"not held: not testable, needs 2 seeds of each run with a value, has {len(mine)} and {len(theirs)}"
        return ClaimResult(claim, False, verdict, "", n, None, None, None, None, censored)
    mean = statistics.fmean(mine) - statistics.fmean(theirs)
    va, vb = statistics.variance(mine) / len(mine), statistics.variance(theirs) / len(theirs)
    se = math.sqrt(va + vb)
    if _no_spread(se, mean):
        agreeing = n if (mean - claim.margin < 0) == (claim.direction == "lower") and mean != claim.margin else 0
        return _result(claim, "sign test", n, mean, (mean, mean), _sign_test(agreeing, n), None, censored)
    dof = (va + vb) ** 2 / (va**2 / (len(mine) - 1) + vb**2 / (len(theirs) - 1))  # Welch–Satterthwaite
    ci = t_interval(mean, se, dof, claim.ci_level)
    return _result(
        claim, "Welch t-test", n, mean, ci, _one_sided_p(claim, mean - claim.margin, se, dof), None, censored
    )


def _no_spread(se: float, mean: float) -> bool:
    """No spread over seeds to test against (identical differences, up to float rounding)."""
    return se <= 1e-12 * max(1.0, abs(mean))


def _sign_test(agreeing: int, n: int) -> float:
    """Exact one-sided sign test: the chance that all n seeds point the claimed way by luck is 0.5^n; any seed the
    other way and it is not shown."""
    return 0.5**n if agreeing == n else 1.0


def _result(
    claim: Claim,
    test: str,
    n: int,
    mean: float,
    ci: tuple[float, float],
    p: float,
    agreeing: int | None,
    censored: int,
) -> ClaimResult:
    held = p < claim.alpha
    shifted = mean - claim.margin
    if held:
        verdict = f"held: p = {p:.3g} < {claim.alpha:g}"
    elif shifted == 0:
        verdict = f"not held: no difference beyond the margin (p = {p:.3g})"
    elif (shifted < 0) == (claim.direction == "lower"):
        verdict = (
            f"not held: the difference points the claimed way but is within the noise (p = {p:.3g} ≥ {claim.alpha:g})"
        )
    else:
        verdict = f"not held: the difference points the other way (p = {p:.3g})"
    return ClaimResult(claim, held, verdict, test, n, mean, ci, p, agreeing, censored)
