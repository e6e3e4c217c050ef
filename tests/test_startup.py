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
