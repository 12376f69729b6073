"""``abstractdiff check`` in its parts: ``plan``, ``run`` and ``report`` each on their own, and ``--import``."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from abstractdiff.adapters.finite_differences import FiniteDifferencesBackend

import abstractdiff as ad
from abstractdiff import cli, testing
from abstractdiff.parity import ParityResult, ParitySummary

AD_LIBRARIES = ("torch", "jax", "jaxlib", "tensorflow", "autograd")
HAS_PARITY = importlib.util.find_spec(cli.PARITY_MODULE) is not None


def make_plan(*argv: str) -> cli.Plan:
    return cli.plan(cli.build_parser().parse_args(["check", *argv]))


# ---------------------------------------------------------------------- plan
def test_plan_jobs_per_device_and_dtype():
    p = make_plan("--backend", "finite_differences", "--scenario", "sum_squares", "--no-training")
    assert p.backends == ["finite_differences"] and p.requested == ["finite_differences"]
    assert p.implicit and p.dtypes == ("float64", "float32") and p.device == "all"
    assert [(j.backend, j.device, j.dtype) for j in p.jobs] == [  # GPU jobs first, then the plan's order
        ("finite_differences", "gpu", "float64"), ("finite_differences", "gpu", "float32"),
        ("finite_differences", "cpu", "float64"), ("finite_differences", "cpu", "float32"),
    ]
    assert all(j.implicit and j.scenarios == ("sum_squares",) for j in p.jobs)
    assert p.ticks == 4 * 2  # one scenario, explicit and implicit, four jobs
    assert p.problems == [] and p.notes == [] and not p.parity
    assert p.parity_skip == "training parity: skipped (--no-training)"


def test_plan_options_restrict_the_jobs():
    p = make_plan("--backend", "finite_differences", "--device", "cpu", "--dtype", "float32", "--no-implicit",
                  "--jobs", "3", "--max-failures", "5", "--no-training")
    assert [(j.device, j.dtype, j.implicit) for j in p.jobs] == [("cpu", "float32", False)]
    assert p.ticks == len(testing.default_scenarios("float32"))
    assert p.workers == 1  # never more workers than jobs
    assert p.max_failures == 5


@pytest.mark.skipif(not HAS_PARITY, reason="abstractdiff.parity is not installed")
def test_plan_parity_runs_on_the_backends_that_can_load():
    p = make_plan("--backend", "finite_differences", "--backend", "no_such_backend", "--jobs", "4")
    assert p.parity and p.parity_backends == ["finite_differences"] and p.parity_skip == ""
    assert p.workers == 4 and p.ticks == 4 * 2 * len(testing.default_scenarios("float64")) + 1
    # nothing can load: parity is not run, so it cannot say "all runs agree" about nothing
    p = make_plan("--backend", "no_such_backend")
    assert not p.parity and p.parity_skip == "training parity: skipped (no backend to train)"


def test_plan_requested_unknown_backend_is_a_problem():
    p = make_plan("--backend", "no_such_backend", "--backend", "finite_differences", "--no-training")
    assert p.backends == ["no_such_backend", "finite_differences"]
    assert len(p.problems) == 1 and p.notes == []
    assert p.problems[0].startswith("no_such_backend: cannot load: UnknownBackendError: no backend named")
    assert {j.backend for j in p.jobs} == {"finite_differences"}


def test_plan_unavailable_backend_is_a_note(monkeypatch, clean_registry):
    ad.register_backend("needs_missing", lambda **o: None, requires=("no_such_module_for_cli_tests",))
    monkeypatch.setattr(cli, "available_backends", lambda: ["finite_differences", "implicit", "needs_missing"])
    p = make_plan("--no-training")
    assert p.backends == ["finite_differences", "needs_missing"]  # the implicit wrapper is a mode, not a backend
    assert p.problems == [] and len(p.notes) == 1
    assert p.notes[0].startswith("needs_missing: cannot load: backend 'needs_missing' needs the "
                                 "'no_such_module_for_cli_tests' library")
    assert {j.backend for j in p.jobs} == {"finite_differences"}


def test_planning_imports_no_ad_library():
    code = ("import sys; from abstractdiff import cli; "
            "p = cli.plan(cli.build_parser().parse_args(['check'])); "
            f"print(len(p.jobs) > 0, sorted(m for m in {AD_LIBRARIES!r} if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True []"


def test_cli_source_names_no_backend():
    source = Path(cli.__file__).read_text(encoding="utf-8")
    for name in ("torch", "jax", "tensorflow", "autograd", "finite_differences", "adapters"):
        assert name not in source, name


# ---------------------------------------------------------------------- report
def make_report(label: str, dtype: str = "float64", *, ok: bool = True, grad: tuple[float, ...] = (2.0, 4.0),
                error: float = 0.0) -> testing.Report:
    """A one-result report, with the stored output ``compare_reports`` needs."""
    scenario = f"sum_squares[{dtype}]"
    problems = [] if ok else [f"gradient: max relative error {error:.2e} exceeds rtol 1e-09"]
    rep = testing.Report(label, "cpu", [testing.Result(label, "cpu", scenario, "sum_squares", dtype, "gradient", ok,
                                                       error, 1e-9, 0.01, problems)])
    rep.outputs[(scenario, "gradient", "gradient")] = np.array(grad)
    return rep


def hand_plan(*names: str, requested: tuple[str, ...] = (), **changes) -> cli.Plan:
    jobs = [cli.Job(n, "cpu", "float64", False, None) for n in names]
    plan = cli.Plan(backends=list(names), requested=list(requested), dtypes=("float64",), device="cpu",
                    implicit=False, jobs=jobs, parity_skip="training parity: skipped (--no-training)")
    for key, value in changes.items():
        setattr(plan, key, value)
    return plan


def test_report_passing():
    plan = hand_plan("exact_a")
    lines, data, status = cli.report(plan, cli.Outcome([cli.JobResult(plan.jobs[0], [make_report("exact_a")])]))
    assert status == 0 and data["ok"] is True
    assert lines[0] == "abstractdiff check: 1 backend(s) (exact_a), explicit; dtypes float64; device cpu"
    assert any(line.startswith("exact_a float64 ") and "ok 0.0e+00" in line for line in lines)
    assert "  skipped: fewer than two backends ran" in lines and "  skipped: --device cpu" in lines
    assert "failures:" not in lines
    assert lines[-1].startswith("PASS: 1 backend x device x dtype runs, 1 checks, 0 failure(s)")
    json.dumps(data, default=str)


def test_report_failing_report_exits_1_with_fail_lines():
    plan = hand_plan("exact_a", max_failures=10)
    outcome = cli.Outcome([cli.JobResult(plan.jobs[0], [make_report("exact_a", ok=False, error=1e-3)])])
    lines, data, status = cli.report(plan, outcome)
    assert status == 1 and data["ok"] is False
    assert any(line.startswith("exact_a float64 ") and "FAIL 1.0e-03" in line for line in lines)
    assert "failures:" in lines
    assert "  exact_a [cpu] sum_squares[float64] gradient (float64): gradient: max relative error 1.00e-03 " \
           "exceeds rtol 1e-09" in lines
    assert lines[-1].startswith("FAIL: 1 backend x device x dtype runs, 1 checks, 1 failure(s)")
    assert data["failures"] == [lines[lines.index("failures:") + 1].strip()]


def test_report_exact_figure_leaves_out_approximate_pairs():
    plan = hand_plan("exact_a", "exact_b", "approx")
    results = [cli.JobResult(plan.jobs[0], [make_report("exact_a")]),
               cli.JobResult(plan.jobs[1], [make_report("exact_b", grad=(2.0, 4.0 + 4e-12))]),
               cli.JobResult(plan.jobs[2], [make_report("approx", grad=(2.0, 4.0 + 4e-10))], approximate=["approx"])]
    lines, _, status = cli.report(plan, cli.Outcome(results))
    assert status == 0
    line = next(line for line in lines if line.startswith("  float64: "))
    assert line.startswith("  float64: 3 of 3 pairs agree; largest difference 1.0e-10 (exact_a vs approx)")
    assert line.endswith("; between exact backends 1.0e-12 (exact_a vs exact_b)")
    # without the approximate labels every pair counts as exact: no separate figure
    for r in results:
        r.approximate = []
    lines, _, _ = cli.report(plan, cli.Outcome(results))
    assert "between exact backends" not in next(line for line in lines if line.startswith("  float64: "))


def test_report_disagreeing_pair_fails():
    plan = hand_plan("exact_a", "exact_b")
    results = [cli.JobResult(plan.jobs[0], [make_report("exact_a")]),
               cli.JobResult(plan.jobs[1], [make_report("exact_b", grad=(2.0, 4.1))])]
    lines, data, status = cli.report(plan, cli.Outcome(results))
    assert status == 1 and data["agreement"][0]["ok"] is False
    assert "    exact_a vs exact_b: DISAGREE on 1 of 1 results (max relative difference 2.5e-02)" in lines
    assert lines[-1].startswith("FAIL: 2 backend x device x dtype runs, 2 checks, 1 failure(s)")


def test_report_load_errors_problem_or_note():
    plan = hand_plan("exact_a", "missing", "broken", requested=())
    results = [cli.JobResult(plan.jobs[0], [make_report("exact_a")]),
               cli.JobResult(plan.jobs[1], error="BackendUnavailableError: its library is not installed"),
               cli.JobResult(plan.jobs[2], error="RuntimeError: broken install")]
    lines, data, status = cli.report(plan, cli.Outcome(results))
    assert "  missing: cannot load: BackendUnavailableError: its library is not installed" in lines  # a note
    assert data["problems"] == ["broken: cannot load: RuntimeError: broken install"]
    assert status == 1 and lines[-1].startswith("FAIL: 1 backend x device x dtype runs, 1 checks, 1 failure(s)")
    plan.requested = ["missing"]  # a backend asked for by name must load
    _, data, _ = cli.report(plan, cli.Outcome(results))
    assert len(data["problems"]) == 2


def test_report_nothing_ran_is_a_failure():
    lines, data, status = cli.report(hand_plan(device="gpu"), cli.Outcome())
    assert status == 1 and data["problems"] == ["nothing ran: no backend was available with a GPU"]
    assert "conformance: nothing ran" in lines


def parity_summary(*statuses: str) -> ParitySummary:
    runs = [ParityResult("exact_a", "explicit", "cpu", "float64", s, 1e-3 if s == "fail" else 1e-12, 1e-10,
                         reason="no library" if s == "skip" else "") for s in statuses]
    return ParitySummary(results=runs, steps=50, rule="Adam()")


def assert_consistent(lines: list[str], status: int, parity: ParitySummary) -> str:
    """The last summary line is the verdict; the parity line speaks for parity alone."""
    assert lines[-1].startswith("PASS: " if status == 0 else "FAIL: ")
    assert not any(line.strip() in ("all runs agree", "SOME RUNS DISAGREE") for line in lines)
    parity_line = next(line for line in lines if line.startswith("  training parity: "))
    if status:
        assert " agree" not in parity_line or (parity.ok and any(r.status == "pass" for r in parity.results))
    return parity_line


@pytest.mark.parametrize(
    "conformance_ok, statuses, expected",
    [
        (False, ("skip",), "  training parity: nothing compared (1 skipped)"),
        (False, (), "  training parity: nothing compared (0 skipped)"),
        (False, ("pass", "skip"), "  training parity: ok (all 1 runs agree with the numpy reference, 1 skipped)"),
        (True, ("pass", "fail"), "  training parity: FAIL (1 of 2 runs disagree or raised)"),
        (True, ("pass",), "  training parity: ok (all 1 runs agree with the numpy reference)"),
    ],
)
def test_report_parity_summary_never_contradicts_the_verdict(conformance_ok, statuses, expected):
    plan = hand_plan("exact_a", parity=True, parity_skip="")
    parity = parity_summary(*statuses)
    outcome = cli.Outcome([cli.JobResult(plan.jobs[0], [make_report("exact_a", ok=conformance_ok)])], parity=parity)
    lines, data, status = cli.report(plan, outcome)
    assert status == (0 if conformance_ok and parity.ok else 1)
    assert assert_consistent(lines, status, parity) == expected
    assert data["training_parity"]["ok"] is parity.ok
    if "fail" in statuses:  # a parity failure is listed and counted like any other
        assert "  training parity: exact_a explicit cpu float64: FAIL max rel diff 1.0e-03 > rtol 1e-10" in lines
        assert lines[-1].startswith("FAIL: 1 backend x device x dtype runs, 1 checks, 1 failure(s)")


def test_report_parity_error_is_a_failure():
    plan = hand_plan("exact_a", parity=True, parity_skip="")
    outcome = cli.Outcome([cli.JobResult(plan.jobs[0], [make_report("exact_a")])], parity_error="RuntimeError: x")
    lines, data, status = cli.report(plan, outcome)
    assert status == 1 and "training parity: ERROR RuntimeError: x" in lines
    assert data["training_parity"] == {"ok": False, "error": "RuntimeError: x"}
    assert lines[-1].startswith("FAIL: 1 backend x device x dtype runs, 1 checks, 1 failure(s)")


@pytest.mark.skipif(not HAS_PARITY, reason="abstractdiff.parity is not installed")
def test_failing_check_does_not_end_with_all_runs_agree(capsys):
    """End to end: a backend that cannot load fails the check while parity compares nothing (it leaves
    finite differences out); the parity block used to end with "all runs agree" just above FAIL."""
    argv = ["check", "--backend", "finite_differences", "--backend", "no_such_backend", "--jobs", "1",
            "--no-progress", "--device", "cpu", "--dtype", "float64", "--scenario", "sum_squares", "--no-implicit"]
    assert cli.main(argv) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("FAIL: 1 backend x device x dtype runs, 10 checks, 1 failure(s)")
    assert not any(line.strip() == "all runs agree" for line in lines)
    assert "  training parity: nothing compared (1 skipped)" in lines


# ---------------------------------------------------------------------- run
def test_run_serially():
    p = make_plan("--backend", "finite_differences", "--scenario", "sum_squares", "--jobs", "1", "--no-training",
                  "--device", "cpu")
    ticks: list[str] = []
    outcome = cli.run(p, ticks.append)
    assert len(ticks) == p.ticks == 4
    assert ticks[0] == "finite_differences cpu float64"
    assert [(r.job.dtype, r.error, r.skipped) for r in outcome.results] == [("float64", None, None),
                                                                             ("float32", None, None)]
    assert [rep.backend for rep in outcome.results[0].reports] == ["finite_differences",
                                                                   "implicit(finite_differences)"]
    assert outcome.approximate == {"finite_differences", "implicit(finite_differences)"}
    assert outcome.parity is None and outcome.parity_error is None and outcome.seconds > 0
    lines, _, status = cli.report(p, outcome)
    assert status == 0 and lines[-1].startswith("PASS: 4 backend x device x dtype runs")


def test_run_reports_a_backend_that_fails_to_load(clean_registry):
    def refuse(**options):
        raise RuntimeError("cannot start")

    ad.register_backend("refusing", refuse)
    p = make_plan("--backend", "refusing", "--jobs", "1", "--no-training", "--device", "cpu", "--dtype", "float64")
    outcome = cli.run(p, lambda label: None)
    assert [r.error for r in outcome.results] == ["RuntimeError: cannot start"]
    assert cli.report(p, outcome)[1]["problems"] == ["refusing: cannot load: RuntimeError: cannot start"]


def test_start_order_puts_gpu_jobs_first_and_is_stable():
    jobs = [cli.Job(n, d, t, True, None) for n in ("b", "a") for d in ("cpu", "gpu") for t in cli.DTYPES]
    order = [(j.backend, j.device, j.dtype) for j in cli._start_order(jobs)]
    assert order == [("b", "gpu", "float64"), ("b", "gpu", "float32"), ("a", "gpu", "float64"),
                     ("a", "gpu", "float32"), ("b", "cpu", "float64"), ("b", "cpu", "float32"),
                     ("a", "cpu", "float64"), ("a", "cpu", "float32")]


def test_worker_logging_is_quiet_in_workers_only():
    code = textwrap.dedent("""
        import logging
        from abstractdiff import cli
        chatty = logging.getLogger("some_library")
        chatty.setLevel(logging.INFO)
        cli._init_worker(None, ())
        print(logging.getLogger().level == logging.ERROR, chatty.level == logging.ERROR, cli._in_worker)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True", "True"]


# ---------------------------------------------------------------------- --import
REGISTERING_MODULE = '''
import abstractdiff as ad
from abstractdiff.adapters.finite_differences import FiniteDifferencesBackend


class CliFd(FiniteDifferencesBackend):
    name = "cli_fd_test"


ad.register_backend("cli_fd_test", lambda **options: CliFd(**options))
'''


def test_import_registers_a_backend_in_the_worker_processes(tmp_path):
    (tmp_path / "cli_fd_test_module.py").write_text(REGISTERING_MODULE, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    argv = ["check", "--import", "cli_fd_test_module", "--backend", "cli_fd_test", "--jobs", "2", "--no-progress",
            "--no-training", "--device", "cpu", "--scenario", "sum_squares", "--json", str(tmp_path / "out.json")]
    result = subprocess.run([sys.executable, "-m", "abstractdiff.cli", *argv], capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "cli_fd_test float64 " in out and "cli_fd_test float32 " in out  # two jobs: two worker processes
    assert "implicit(cli_fd_test) float64 " in out
    assert "float64: 1 of 1 pairs agree" in out and "between exact backends" not in out
    assert out.splitlines()[-1].startswith("PASS: 4 backend x device x dtype runs")
    assert json.loads((tmp_path / "out.json").read_text())["problems"] == []


def test_import_failure_is_a_usage_error(capsys, tmp_path, monkeypatch):
    (tmp_path / "cli_broken_module.py").write_text("raise RuntimeError('boom')\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    for module, message in [("cli_broken_module", "--import cli_broken_module: RuntimeError: boom"),
                            ("no_such_module_for_cli", "--import no_such_module_for_cli: ModuleNotFoundError")]:
        with pytest.raises(SystemExit) as exc:
            cli.main(["check", "--import", module])
        assert exc.value.code == 2
        assert message in capsys.readouterr().err


# ---------------------------------------------------------------------- composition
class _OffPullbackFd(FiniteDifferencesBackend):
    """Finite differences whose pullbacks are 0.1% too large: a wrong inner kernel."""

    name = "off_pullback_fd"

    def flat_value_and_pullback(self, fn, xs, data):
        y, aux, pullback = super().flat_value_and_pullback(fn, xs, data)
        return y, aux, lambda dy: [g * 1.001 for g in pullback(dy)]


def test_plan_composition_goes_to_each_backends_first_cpu_job(clean_registry):
    ad.register_backend("off_pullback_fd", _OffPullbackFd)
    p = make_plan("--backend", "finite_differences", "--backend", "off_pullback_fd", "--scenario", "sum_squares",
                  "--no-training")
    pairs = {(j.backend, j.device, j.dtype): j.composition for j in p.jobs if j.composition}
    assert pairs == {("finite_differences", "cpu", "float64"): ("off_pullback_fd",),
                     ("off_pullback_fd", "cpu", "float64"): ("finite_differences",)}
    assert p.composition and p.ticks == 2 * 2 * 2 * 2 + 2  # jobs x (explicit, implicit) + one composition tick each
    p = make_plan("--backend", "finite_differences", "--backend", "off_pullback_fd", "--no-composition",
                  "--no-training")
    assert not p.composition and not any(j.composition for j in p.jobs)
    assert make_plan("--backend", "finite_differences", "--dtype", "float32").jobs[0].composition == ()


def test_report_composition_lines_and_failures():
    from abstractdiff.testing._composition import PairResult

    plan = hand_plan("exact_a", "exact_b")
    good = PairResult("exact_a", "exact_b", "float64", passed=["value", "gradient", "pullback"],
                      refused={"pushforward": "CompositionError", "hessian": "CompositionError"})
    bad = PairResult("exact_b", "exact_a", "float64", passed=["value"], failure="max abs diff 3e-04 (gradient)")
    results = [cli.JobResult(plan.jobs[0], [make_report("exact_a")], composition=[good]),
               cli.JobResult(plan.jobs[1], [make_report("exact_b")], composition=[bad])]
    lines, data, status = cli.report(plan, cli.Outcome(results))
    assert ("  composition: exact_a over exact_b: ok (gradient, pullback); pushforward refused (CompositionError); "
            "hessian refused (CompositionError)") in lines
    assert "  composition: exact_b over exact_a: FAIL max abs diff 3e-04 (gradient)" in lines
    assert status == 1 and lines[-1].startswith("FAIL: 2 backend x device x dtype runs, 2 checks, 1 failure(s)")
    assert [c["ok"] for c in data["composition"]] == [True, False]
    plan.composition = False
    lines, _, _ = cli.report(plan, cli.Outcome(results[:1]))
    assert "  skipped: --no-composition" in lines


@pytest.mark.skipif("autograd" not in ad.available_backends(), reason="needs an exact backend: autograd")
def test_check_composition_passing_and_failing_pairs(capsys, clean_registry):
    ad.register_backend("off_pullback_fd", _OffPullbackFd)
    argv = ["check", "--backend", "autograd", "--backend", "finite_differences", "--backend", "off_pullback_fd",
            "--jobs", "1", "--no-progress", "--no-training", "--no-implicit", "--device", "cpu", "--dtype",
            "float64", "--scenario", "sum_squares"]
    assert cli.main(argv) == 1
    lines = capsys.readouterr().out.splitlines()
    failures = lines[lines.index("failures:"):]
    pairs = [line for line in lines[:lines.index("failures:")] if line.startswith("  composition: ")]
    # finite differences approximate: they are inners only
    assert pairs[0] == "  composition: autograd over finite_differences: ok (gradient, pullback, pushforward, hessian)"
    assert pairs[1].startswith("  composition: autograd over off_pullback_fd: FAIL max abs diff ")
    assert pairs[1].endswith("(gradient)") and len(pairs) == 2
    assert pairs[1] in failures
    assert lines[-1].startswith("FAIL: ")  # (the wrong backend's own conformance fails too)
    assert cli.main([*argv[:5], *argv[7:], "--no-composition"]) == 0
    assert not any(line.startswith("  composition: ") for line in capsys.readouterr().out.splitlines())


def test_table_rows_speak_for_their_own_dtype():
    # issue 24 item 8: a float64 job's switching steps of float32 belonged to its float64 row
    rep = make_report("exact_a")
    bad = testing.Result("exact_a", "cpu", "switching[float32]", "switching", "float32", "gradient", False,
                         1e-3, 1e-5, 0.01, ["gradient: max relative error 1.00e-03 exceeds rtol 1e-05"])
    rep.results.append(bad)
    table = cli._table([rep]).splitlines()
    f64 = next(line for line in table if line.startswith("exact_a float64"))
    f32 = next(line for line in table if line.startswith("exact_a float32"))
    assert "ok 0.0e+00" in f64 and "FAIL" not in f64
    assert "FAIL 1.0e-03" in f32
