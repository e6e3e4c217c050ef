"""The README's and docs/' blocks marked `<!-- runnable slow -->` run as written (tests/test_readme.py runs the
quick ones in the fast suite): each starts a simulator, a gateway or a run, and takes seconds to a minute."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_readme import RUNNABLE, Block, check_block

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.mark.parametrize("block", [b for b in RUNNABLE if b.slow], ids=lambda b: b.name)
def test_a_slow_runnable_block_runs_as_written(block: Block, tmp_path: Path):
    check_block(block, tmp_path)
