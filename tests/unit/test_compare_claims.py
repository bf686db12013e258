"""Claims as data in a comparison file: validation at load, the statistical tests over seeds, intervals and the
report. The tests are checked against scipy's own t-tests, computed independently of fairfl's code."""

from __future__ import annotations

import json
import math
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from scipy import stats

from fairfl.compose.compare import ComparisonResult, SeedSummary, Stat, load_comparison, write_report
from fairfl.compose.compare.claims import Claim, evaluate_claim
from fairfl.compose.compare.report import claim_cells
from fairfl.compose.results import FAIRNESS_COLUMNS
from fairfl.config import ConfigError
from tests.compare_support import TINY_EXPERIMENT

BASE = TINY_EXPERIMENT


def spec_file(tmp_path: Path, claims: Any, **changes: Any) -> Path:
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(BASE))
    spec: dict[str, Any] = {
        "name": "claims",
        "base": "base.yaml",
        "seeds": [0, 1, 2, 3, 4],
        "runs": [
            {"label": "Fair", "set": {"strategy.name": "qffl"}},
            {"label": "FedAvg", "set": {"strategy.name": "fedavg"}},
            {"label": "FedAvg other data", "set": {"data.params.alpha": 0.5}},
        ],
        "claims": claims,
        **changes,
    }
    path = tmp_path / "compare.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False, allow_unicode=True))
    return path


def claim_error(tmp_path: Path, claim: dict[str, Any], **changes: Any) -> str:
    with pytest.raises(ConfigError) as info:
        load_comparison(spec_file(tmp_path, [claim], **changes))
    return str(info.value)


GOOD = {"claim": "Fair is fairer", "run": "Fair", "metric": "variance", "is": "lower", "than": "FedAvg"}


def test_claims_load_with_defaults_and_a_statement(tmp_path: Path) -> None:
    spec = load_comparison(
        spec_file(tmp_path, [GOOD, {**GOOD, "claim": None, "metric": "mean", "is": "higher", "margin": -0.5}])
    )
    fair, mean = spec.claims
    assert (fair.text, fair.alpha, fair.margin) == ("Fair is fairer", 0.05, 0.0)
    assert fair.statement() == "Fair variance < FedAvg variance"
    assert mean.text == mean.statement() == "Fair mean > FedAvg mean − 0.5"


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"run": "Nope"}, "claims[0].run: 'Nope' is not a run label; labels: Fair, FedAvg, FedAvg other data"),
        ({"than": "Fair"}, "claims[0].than: a claim compares two different runs, got 'Fair' twice"),
        ({"metric": "accuracy"}, "claims[0].metric: unknown metric 'accuracy'; valid metrics: mean, "),
        ({"metric": "rounds_to_target"}, "claims[0].metric: rounds_to_target needs target_accuracy"),
        ({"is": "smaller"}, "claims[0].is: expected one of lower, higher, got 'smaller'"),
        ({"alpha": 0.5}, "claims[0].alpha: expected a significance level in (0, 0.5)"),
        ({"margin": "half"}, "claims[0].margin: expected a finite number, got 'half'"),
        ({"because": "x"}, "claims[0]: unknown field 'because'; valid fields: claim, run, metric, is, than"),
        ({"claim": ""}, "claims[0].claim: expected the claim in words, got ''"),
    ],
)
def test_bad_claims_name_the_field(tmp_path: Path, change: dict[str, Any], expected: str) -> None:
    assert expected in claim_error(tmp_path, {**GOOD, **change})


def test_missing_claim_field_and_bad_list_are_named(tmp_path: Path) -> None:
    assert (
        claim_error(tmp_path, {k: v for k, v in GOOD.items() if k != "than"})
        == "claims[0].than: required field is missing"
    )
    with pytest.raises(ConfigError, match="claims: expected a list of claims"):
        load_comparison(spec_file(tmp_path, {"run": "Fair"}))


# --- the tests over seeds ---------------------------------------------------------------------------------------------


def seed(label: str, seed: int, variance: float, *, rounds_to_target: float | None = 0.0) -> SeedSummary:
    fairness: dict[str, float | None] = {k: 1.0 for k in FAIRNESS_COLUMNS}
    fairness["variance"] = variance
    extra: dict[str, float | None] = {} if rounds_to_target == 0.0 else {"rounds_to_target": rounds_to_target}
    return SeedSummary(label, seed, 100, fairness, 1.0, [], [], extra=extra)


def runs_of(fair: list[float], fedavg: list[float]) -> list[SeedSummary]:
    return [seed("Fair", i, v) for i, v in enumerate(fair)] + [seed("FedAvg", i, v) for i, v in enumerate(fedavg)]


CLAIM = Claim("Fair is fairer", "Fair", "variance", "lower", "FedAvg")


def test_paired_claim_matches_scipys_paired_t_test_and_holds() -> None:
    fair, fedavg = [40.0, 52.0, 47.0, 44.0, 50.0], [61.0, 70.0, 58.0, 66.0, 72.0]
    result = evaluate_claim(CLAIM, runs_of(fair, fedavg), lambda s: True)
    expected = stats.ttest_rel(fair, fedavg, alternative="less")
    assert result.test == "paired t-test" and result.n == 5
    assert result.p_value == pytest.approx(expected.pvalue, rel=1e-9)
    assert result.held and result.verdict.startswith("held: p = ")
    assert result.agreeing_seeds == 5
    diffs = [a - b for a, b in zip(fair, fedavg, strict=True)]
    # The 1 − 2·alpha two-sided interval: its upper end is the one-sided 95% bound the test rejects against.
    lo, hi = stats.t.interval(0.90, 4, loc=sum(diffs) / 5, scale=stats.sem(diffs))
    assert result.difference == pytest.approx(sum(diffs) / 5)
    assert result.ci == pytest.approx((lo, hi))
    assert hi == pytest.approx(expected.confidence_interval(0.95).high)


def test_a_gap_inside_the_noise_is_not_held_and_says_so() -> None:
    fair, fedavg = [40.0, 70.0, 47.0, 64.0, 50.0], [61.0, 50.0, 58.0, 46.0, 72.0]
    result = evaluate_claim(CLAIM, runs_of(fair, fedavg), lambda s: True)
    assert result.p_value == pytest.approx(stats.ttest_rel(fair, fedavg, alternative="less").pvalue)
    assert not result.held and "points the claimed way but is within the noise" in result.verdict
    assert result.agreeing_seeds == 3


def test_the_opposite_direction_is_not_held() -> None:
    result = evaluate_claim(CLAIM, runs_of([60.0, 71.0, 66.0], [50.0, 52.0, 55.0]), lambda s: True)
    assert not result.held and "points the other way" in result.verdict and result.p_value > 0.9


def test_margin_shifts_the_hypothesis_not_the_reported_difference() -> None:
    claim = Claim("mean within 0.5", "Fair", "variance", "higher", "FedAvg", margin=-0.5)
    fair, fedavg = [10.0, 10.1, 9.9, 10.0], [10.2, 10.3, 10.1, 10.25]  # 0.1 to 0.25 lower, never 0.5
    result = evaluate_claim(claim, runs_of(fair, fedavg), lambda s: True)
    expected = stats.ttest_1samp([a - b + 0.5 for a, b in zip(fair, fedavg, strict=True)], 0.0, alternative="greater")
    assert result.p_value == pytest.approx(expected.pvalue)
    assert result.held and result.difference == pytest.approx(-0.2125)


def test_seeds_on_different_partitions_use_welchs_test() -> None:
    fair, fedavg = [40.0, 52.0, 47.0, 44.0, 50.0], [61.0, 70.0, 58.0]
    result = evaluate_claim(CLAIM, runs_of(fair, fedavg), lambda s: False)
    expected = stats.ttest_ind(fair, fedavg, equal_var=False, alternative="less")
    assert result.test == "Welch t-test" and result.n == 3 and result.agreeing_seeds is None
    assert result.p_value == pytest.approx(expected.pvalue, rel=1e-9)
    two_sided = stats.ttest_ind(fair, fedavg, equal_var=False).confidence_interval(0.90)
    assert result.ci == pytest.approx((two_sided.low, two_sided.high))
    assert result.difference == pytest.approx(sum(fair) / 5 - sum(fedavg) / 3)


def test_one_seed_per_side_is_not_testable() -> None:
    result = evaluate_claim(CLAIM, runs_of([40.0], [60.0]), lambda s: True)
    assert not result.held and result.p_value is None and "not testable" in result.verdict


def test_identical_differences_fall_back_to_the_exact_sign_test() -> None:
    # No spread over seeds: a t statistic would be infinite; the sign test gives 0.5^n when every seed agrees.
    five = evaluate_claim(
        CLAIM, runs_of([40.0, 50.0, 60.0, 70.0, 80.0], [41.0, 51.0, 61.0, 71.0, 81.0]), lambda s: True
    )
    assert (five.test, five.held, five.p_value, five.agreeing_seeds) == ("sign test", True, 0.5**5, 5)
    assert five.ci == pytest.approx((-1.0, -1.0))
    three = evaluate_claim(CLAIM, runs_of([40.0, 50.0, 60.0], [41.0, 51.0, 61.0]), lambda s: True)
    assert (three.held, three.p_value) == (False, 0.125)  # 3 seeds cannot show it at 0.05
    same = evaluate_claim(CLAIM, runs_of([40.0, 50.0, 60.0], [40.0, 50.0, 60.0]), lambda s: True)
    assert not same.held and "no difference beyond the margin" in same.verdict


def test_held_exactly_when_the_interval_clears_the_margin_on_the_claimed_side() -> None:
    import random

    rng = random.Random(7)
    for trial in range(200):
        fair = [rng.gauss(50, 5) for _ in range(5)]
        fedavg = [v + rng.gauss(-2.5, 4) for v in fair]
        direction, margin = rng.choice(["lower", "higher"]), rng.choice([0.0, -1.0, 1.0])
        claim = Claim("c", "Fair", "variance", direction, "FedAvg", margin)
        for paired in (True, False):
            r = evaluate_claim(claim, runs_of(fair, fedavg), lambda s, paired=paired: paired)
            beyond = r.ci[1] < margin if direction == "lower" else r.ci[0] > margin
            assert r.held == beyond, (trial, paired, r)


def test_welch_higher_matches_scipy() -> None:
    claim = Claim("fairer", "Fair", "variance", "higher", "FedAvg")
    fair, fedavg = [61.0, 70.0, 58.0, 66.0], [40.0, 52.0, 47.0, 44.0, 50.0]
    result = evaluate_claim(claim, runs_of(fair, fedavg), lambda s: False)
    assert result.p_value == pytest.approx(stats.ttest_ind(fair, fedavg, equal_var=False, alternative="greater").pvalue)
    assert result.held


def test_a_number_as_baseline_is_a_one_sample_test(tmp_path: Path) -> None:
    spec = load_comparison(spec_file(tmp_path, [{**GOOD, "claim": None, "is": "higher", "than": 40}]))
    (claim,) = spec.claims
    assert claim.threshold and claim.statement() == "Fair variance > 40"
    values = [40.5, 41.2, 43.0, 41.9, 42.4]
    result = evaluate_claim(claim, runs_of(values, []), lambda s: pytest.fail("no pairing against a number"))
    assert result.test == "one-sample t-test" and result.n == 5
    assert result.p_value == pytest.approx(stats.ttest_1samp(values, 40.0, alternative="greater").pvalue)
    assert result.held and result.difference == pytest.approx(sum(values) / 5 - 40)
    perfect = evaluate_claim(claim, runs_of([1.0] * 5, []), lambda s: True)  # NMI 1.0 every seed: the sign test
    assert (perfect.test, perfect.held) == ("sign test", False)  # 1.0 is not above 40
    with pytest.raises(ConfigError, match=re.escape("claims[0].than: 'Nope' is not a run label or a number")):
        load_comparison(spec_file(tmp_path, [{**GOOD, "than": "Nope"}]))


def test_missing_seeds_make_a_claim_incomplete_never_held() -> None:
    fair, fedavg = [40.0, 52.0, 47.0, 44.0, 50.0], [61.0, 70.0, 58.0, 66.0, 72.0]
    result = evaluate_claim(CLAIM, runs_of(fair, fedavg), lambda s: True, {"Fair": 6, "FedAvg": 5})
    assert not result.held and result.verdict.startswith("incomplete (Fair has 5 of 6 seeds): held: p = ")
    complete = evaluate_claim(CLAIM, runs_of(fair, fedavg), lambda s: True, {"Fair": 5, "FedAvg": 5})
    assert complete.held


def test_a_faster_side_that_never_reached_the_target_is_not_held() -> None:
    # Counting the claimed-faster run's misses at final round + 1 would flatter the claim: refused.
    claim = Claim("faster", "Fair", "rounds_to_target", "lower", "FedAvg")
    runs = [seed("Fair", i, 0.0, rounds_to_target=None) for i in range(5)]
    runs += [seed("FedAvg", i, 0.0, rounds_to_target=r) for i, r in enumerate([150.0, 160.0, 170.0, 180.0, 190.0])]
    result = evaluate_claim(claim, runs, lambda s: True)
    assert not result.held and result.p_value is None
    assert result.verdict.endswith(
        "Fair never reached the target in seed(s) 0, 1, 2, 3, 4, so its rounds to the target are unknown where the "
        "other side reached it"
    )
    welch = evaluate_claim(claim, runs, lambda s: False)  # unpaired: any miss of the faster side
    assert not welch.held and "seed(s) 0, 1, 2, 3, 4, so its rounds to the target are unknown" in welch.verdict
    # A seed where neither side reached the target is no difference, not a refusal: the others decide.
    runs = [seed("Fair", i, 0.0, rounds_to_target=r) for i, r in enumerate([40.0, 45.0, 50.0, 42.0, None])]
    runs += [seed("FedAvg", i, 0.0, rounds_to_target=r) for i, r in enumerate([150.0, 160.0, 170.0, 180.0, None])]
    both = evaluate_claim(claim, runs, lambda s: True)
    expected = stats.ttest_rel([40.0, 45.0, 50.0, 42.0, 101.0], [150.0, 160.0, 170.0, 180.0, 101.0], alternative="less")
    assert both.p_value == pytest.approx(expected.pvalue) and both.censored == 2 and both.agreeing_seeds == 4


def test_rounds_to_target_counts_a_seed_that_never_reached_it_at_final_round_plus_one() -> None:
    claim = Claim("faster", "Fair", "rounds_to_target", "lower", "FedAvg")
    runs = [seed("Fair", i, 0.0, rounds_to_target=r) for i, r in enumerate([40.0, 45.0, 50.0])]
    runs += [seed("FedAvg", i, 0.0, rounds_to_target=r) for i, r in enumerate([None, 90.0, None])]
    result = evaluate_claim(claim, runs, lambda s: True)
    expected = stats.ttest_rel([40.0, 45.0, 50.0], [101.0, 90.0, 101.0], alternative="less")
    assert result.censored == 2 and result.p_value == pytest.approx(expected.pvalue) and result.held


def test_stat_interval_is_the_t_interval_of_the_mean() -> None:
    xs = [80.0, 84.0, 86.0, 83.0, 85.0]
    lo, hi = stats.t.interval(0.95, 4, loc=sum(xs) / 5, scale=stats.sem(xs))
    s = Stat.of(xs)
    assert s.ci == pytest.approx((lo, hi))
    assert s.format_ci() == f"83.60 [{lo:.2f}, {hi:.2f}]"
    assert Stat.of([1.0]).ci is None and Stat.of([1.0]).format_ci() == "1.00"


# --- pairing from the comparison file and the written report ----------------------------------------------------------


def test_pairing_follows_the_data_config(tmp_path: Path) -> None:
    spec = load_comparison(spec_file(tmp_path, [GOOD]))
    assert spec.same_partition("Fair", "FedAvg", 3)  # different strategies, same data: the seeds pair
    assert not spec.same_partition("Fair", "FedAvg other data", 3)


def test_report_lists_each_claim_held_or_not_with_its_test(tmp_path: Path) -> None:
    claims = [
        GOOD,
        {**GOOD, "claim": "FedAvg is fairer", "run": "FedAvg", "than": "Fair"},
        {**GOOD, "claim": "vs other data", "than": "FedAvg other data"},
    ]
    spec = load_comparison(spec_file(tmp_path, claims))
    fair, fedavg = [40.0, 52.0, 47.0, 44.0, 50.0], [61.0, 70.0, 58.0, 66.0, 72.0]
    runs = runs_of(fair, fedavg) + [seed("FedAvg other data", i, v) for i, v in enumerate(fedavg)]
    result = ComparisonResult(spec, tmp_path, 1, "inprocess", runs, [], datetime(2026, 1, 1).astimezone(), 1.0)
    table = write_report(result, tmp_path / "out", "fairfl compare compare.yaml")
    assert "Claims:\n- Fair is fairer: held: p = " in table
    assert "- FedAvg is fairer: not held: the difference points the other way" in table
    md = (tmp_path / "out" / "comparison.md").read_text()
    assert "## Claims" in md and "| Fair is fairer | `Fair variance < FedAvg variance` | paired t-test (5) |" in md
    assert "without a correction for testing several" in md
    assert "| vs other data | `Fair variance < FedAvg other data variance` | Welch t-test (5) |" in md
    assert "95% confidence intervals of the mean over seeds" in md
    report = json.loads((tmp_path / "out" / "comparison.json").read_text())
    held = [(c["claim"], c["held"], c["test"]) for c in report["claims"]]
    assert held == [
        ("Fair is fairer", True, "paired t-test"),
        ("FedAvg is fairer", False, "paired t-test"),
        ("vs other data", True, "Welch t-test"),
    ]
    assert report["claims"][0]["p_value"] == pytest.approx(stats.ttest_rel(fair, fedavg, alternative="less").pvalue)
    assert (
        report["algorithms"][0]["metrics"]["variance"]["ci95"][0]
        < 46.6
        < report["algorithms"][0]["metrics"]["variance"]["ci95"][1]
    )
    assert report["revision"]["commit"]  # this checkout is a git repository


def test_the_readme_claims_example_loads_and_is_tested(tmp_path: Path) -> None:
    """README.md's `claims:` block, as a user would paste it into a comparison file of those runs."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = re.search(r"```yaml\n(claims:\n.*?)```", readme, re.S)
    assert block, "README.md has no ```yaml block starting with claims:"
    claims = yaml.safe_load(block.group(1))["claims"]
    labels = sorted({c["run"] for c in claims} | {c["than"] for c in claims if isinstance(c["than"], str)})
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(BASE))
    spec_dict = {"name": "readme", "base": "base.yaml", "seeds": [0, 1, 2, 3, 4], "claims": claims}
    spec_dict["runs"] = [{"label": label} for label in labels]
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(spec_dict, allow_unicode=True))
    spec = load_comparison(tmp_path / "c.yaml")
    assert [c.statement() for c in spec.claims] == [
        "FedEBA+ variance < FedAvg variance",
        "FedEBA+ mean > FedAvg mean − 0.5",
        "Equitable-FL nmi_all_groups > 0.9",
        "FedEBA+ variance < FedAvg variance / 2",
    ]
    runs = [seed("FedEBA+", i, v) for i, v in enumerate([40.0, 52.0, 47.0, 44.0, 50.0])]
    runs += [seed("FedAvg", i, v) for i, v in enumerate([61.0, 70.0, 58.0, 66.0, 72.0])]
    result = evaluate_claim(spec.claims[0], runs, lambda s: True, {"FedEBA+": 5, "FedAvg": 5})
    assert result.held and result.test == "paired t-test"
    halved = evaluate_claim(spec.claims[3], runs, lambda s: True, {"FedEBA+": 5, "FedAvg": 5})
    ratios = [a / b for a, b in zip([40.0, 52.0, 47.0, 44.0, 50.0], [61.0, 70.0, 58.0, 66.0, 72.0], strict=True)]
    geometric_mean = math.exp(sum(map(math.log, ratios)) / 5)  # ~0.71: lower, but not halved
    assert not halved.held and halved.difference == pytest.approx(geometric_mean)


def test_the_report_row_says_how_many_runs_were_counted_at_final_round_plus_one() -> None:
    from fairfl.compose.compare.report import claim_cells

    claim = Claim("faster", "Fair", "rounds_to_target", "lower", "FedAvg")
    runs = [seed("Fair", i, 0.0, rounds_to_target=r) for i, r in enumerate([40.0, 45.0, 50.0])]
    runs += [seed("FedAvg", i, 0.0, rounds_to_target=r) for i, r in enumerate([None, 90.0, None])]
    verdict = claim_cells(evaluate_claim(claim, runs, lambda s: True).as_dict())[-1]
    assert verdict.startswith("**held**: p = ")
    assert verdict.endswith("; 2 runs never reached the target (counted at final round + 1)")


# --- ratio claims (factor) --------------------------------------------------------------------------------------------


def test_a_factor_claim_is_a_paired_t_test_on_the_logs(tmp_path: Path) -> None:
    spec = load_comparison(spec_file(tmp_path, [{**GOOD, "claim": None, "factor": 2}]))
    (claim,) = spec.claims
    assert claim.statement() == "Fair variance < FedAvg variance / 2"
    fair, fedavg = [20.0, 31.0, 24.0, 22.0, 27.0], [61.0, 70.0, 58.0, 66.0, 72.0]  # 2.2x to 2.9x lower
    result = evaluate_claim(claim, runs_of(fair, fedavg), lambda s: True)
    logs = [math.log(a) - math.log(b) for a, b in zip(fair, fedavg, strict=True)]
    expected = stats.ttest_1samp(logs, -math.log(2), alternative="less")
    assert result.test == "paired t-test" and result.p_value == pytest.approx(expected.pvalue, rel=1e-9)
    assert result.held and result.agreeing_seeds == 5
    assert result.difference == pytest.approx(math.exp(sum(logs) / 5))  # the geometric-mean ratio
    lo, hi = stats.t.interval(0.90, 4, loc=sum(logs) / 5, scale=stats.sem(logs))
    assert result.ci == pytest.approx((math.exp(lo), math.exp(hi)))
    # A 3x claim on the same seeds: the geometric-mean ratio (~0.38) is above 1/3, the other way from the claim.
    triple = evaluate_claim(
        Claim("3x", "Fair", "variance", "lower", "FedAvg", factor=3.0), runs_of(fair, fedavg), lambda s: True
    )
    assert not triple.held and "points the other way" in triple.verdict and triple.agreeing_seeds == 1
    row = claim_cells(result.as_dict())
    assert row[1] == "`Fair variance < FedAvg variance / 2`" and row[3].startswith("×0.")
    assert result.as_dict()["scale"] == "ratio" and result.as_dict()["factor"] == 2.0


def test_a_higher_factor_claim_against_other_partitions_uses_welch_on_the_logs() -> None:
    claim = Claim("10% more", "Fair", "variance", "higher", "FedAvg", factor=1.1)
    fair, fedavg = [66.0, 70.0, 68.0, 73.0], [50.0, 55.0, 52.0, 58.0, 54.0]
    result = evaluate_claim(claim, runs_of(fair, fedavg), lambda s: False)
    a, b = [math.log(v) - math.log(1.1) for v in fair], [math.log(v) for v in fedavg]
    expected = stats.ttest_ind(a, b, equal_var=False, alternative="greater")
    assert result.test == "Welch t-test" and result.p_value == pytest.approx(expected.pvalue, rel=1e-9)
    assert result.held


def test_a_factor_claim_needs_positive_values_and_no_margin(tmp_path: Path) -> None:
    claim = Claim("2x", "Fair", "variance", "lower", "FedAvg", factor=2.0)
    result = evaluate_claim(claim, runs_of([1.0, 0.0, 2.0], [5.0, 6.0, 7.0]), lambda s: True)
    assert not result.held and result.p_value is None
    assert "not testable as a ratio, Fair seed 1 has variance = 0" in result.verdict
    assert "claims[0]: give margin (a difference) or factor (a ratio), not both" in claim_error(
        tmp_path, {**GOOD, "factor": 2, "margin": 1}
    )
    assert "claims[0].factor: expected a ratio > 0" in claim_error(tmp_path, {**GOOD, "factor": 0})
    assert "claims[0].than: a ratio claim needs a positive threshold" in claim_error(
        tmp_path, {**GOOD, "factor": 2, "than": -1}
    )


def test_rounds_to_target_as_a_ratio_keeps_the_censoring_rules() -> None:
    claim = Claim("2x faster", "Fair", "rounds_to_target", "lower", "FedAvg", factor=2.0)
    runs = [seed("Fair", i, 0.0, rounds_to_target=r) for i, r in enumerate([40.0, 45.0, 50.0, 42.0])]
    runs += [seed("FedAvg", i, 0.0, rounds_to_target=r) for i, r in enumerate([None, 90.0, None, 120.0])]
    result = evaluate_claim(claim, runs, lambda s: True)
    logs = [math.log(a / b) for a, b in zip([40.0, 45.0, 50.0, 42.0], [101.0, 90.0, 101.0, 120.0], strict=True)]
    assert result.censored == 2
    assert result.p_value == pytest.approx(stats.ttest_1samp(logs, -math.log(2), alternative="less").pvalue)
    refused = [seed("Fair", i, 0.0, rounds_to_target=None) for i in range(3)]
    refused += [seed("FedAvg", i, 0.0, rounds_to_target=90.0) for i in range(3)]
    assert "never reached the target" in evaluate_claim(claim, refused, lambda s: True).verdict
