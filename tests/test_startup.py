"""Start-up stays lazy: `--help` imports neither pydantic, httpx nor Textual, and a headless run never
imports Textual nor httpx's command line (checked through what a fresh interpreter has in `sys.modules`, not
through timings)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

HEAVY = ("textual", "pydantic", "httpx", "anyio", "uvicorn", "starlette", "prometheus_client")


def loaded_after(code: str, timeout: float = 60) -> set[str]:
    """Top-level packages imported by a fresh interpreter that runs `code` (which may print)."""
    script = code + textwrap.dedent("""
        import json as _json, sys as _sys
        print("\\nMODULES " + _json.dumps(sorted({m.split(".")[0] for m, mod in _sys.modules.items()
                                                  if mod is not None})))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("MODULES ")]
    assert line, out.stdout[-2000:] + out.stderr[-2000:]
    return set(json.loads(line[-1].removeprefix("MODULES ")))


def test_help_imports_nothing_heavy():
    code = textwrap.dedent("""
        from cerevisor_tui.cli import main
        try:
            main(["--help"])
        except SystemExit:
            pass
    """)
    assert not loaded_after(code) & set(HEAVY)


def test_sim_help_still_lists_the_simulator_flags():
    out = subprocess.run([sys.executable, "-m", "cerevisor_tui", "sim", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "--tokens-per-s" in out.stdout and "--max-num-seqs" in out.stdout


def test_a_headless_run_never_imports_textual(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(textwrap.dedent("""
        [[endpoints]]
        name = "sim"
        kind = "simulated"
        sim = { speed = 50.0, ttft_s = 0.05 }

        [[agents]]
        name = "a1"
        prompt = "hi"
        max_tokens = 8
    """))
    code = textwrap.dedent(f"""
        from cerevisor_tui.cli import main
        code = main(["run", {str(config)!r}, "--run-dir", {str(tmp_path / "run")!r}])
        assert code == 0, code
    """)
    modules = loaded_after(code)
    assert "cerevisor_tui" in modules and "httpx" in modules  # it did run
    assert "textual" not in modules
    assert not modules & {"rich", "pygments"}  # httpx's own command line, which its import would take along


def test_a_run_as_its_processs_own_command_freezes_its_start_up_and_one_run_for_a_caller_does_not(tmp_path):
    # heap.py: the process's own command line (the script, `python -m`) keeps what start-up built out of every
    # later collection; `main(argv)` called by a program (the tests' cli_here) leaves that program's collector alone
    workflow = tmp_path / "w.toml"
    workflow.write_text('[[endpoints]]\nname = "sim"\nkind = "simulated"\n[endpoints.sim]\nspeed = 100.0\n\n'
                        '[[agents]]\nname = "a"\nprompt = "hi"\nmax_tokens = 2\n')
    code = textwrap.dedent(f"""
        import gc, sys
        from cerevisor_tui.cli import main
        called = main(["run", {str(workflow)!r}, "--run-dir", {str(tmp_path / "called")!r}])
        after_call = gc.get_freeze_count()
        sys.argv = ["cerevisor-tui", "run", {str(workflow)!r}, "--run-dir", {str(tmp_path / "own")!r}]
        own = main()
        print("FROZEN", called, after_call, own, gc.get_freeze_count())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("FROZEN ")), None)
    assert line is not None, out.stdout[-2000:] + out.stderr[-2000:]
    called, after_call, own, frozen = map(int, line.split()[1:])
    assert called == 0 and own == 0
    assert after_call == 0  # a caller's collector as it was
    assert frozen > 10_000  # the run's own start-up: modules, classes, schemas, the config
