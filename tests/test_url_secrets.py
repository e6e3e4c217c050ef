"""A URL that holds credentials is refused without being repeated whole: the message names the entry and the
problem, and the user:password@ in it is [redacted]."""

from __future__ import annotations

import json

import pytest

from cerevisor_tui.cli import main as cli_main
from cerevisor_tui.config.models import shown_url
from tests.test_validation import cli, one_line_exit_2

PASSWORD = "hunter2-canary-7f3a"


@pytest.mark.parametrize(
    "url",
    [
        f"http://admin:{PASSWORD}@127.0.0.1:8001",
        f"http://{PASSWORD}@127.0.0.1:8001/",
        f"http://admin:{PASSWORD}@127.0.0.1:99999",
    ],
)  # fails first on its port
def test_a_metrics_url_with_credentials_is_refused_without_its_password(tmp_path, capsys, url):
    cfg = tmp_path / "w.toml"
    cfg.write_text(
        '[[endpoints]]\nname = "e"\nbase_url = "http://127.0.0.1:8000/v1"\n'
        f'metrics_urls = ["http://127.0.0.1:8002", {json.dumps(url)}]\n'
        '[[agents]]\nname = "a"\nprompt = "p"\n'
    )
    err = one_line_exit_2(cli_main(["run", str(cfg)]), capsys.readouterr().err)
    assert "endpoints[0] (e).metrics_urls: [1] 'http://[redacted]@127.0.0.1:" in err, err
    assert PASSWORD not in err


def test_probe_of_a_url_that_is_not_http_does_not_repeat_its_password():
    proc = cli("probe", f"ftp://admin:{PASSWORD}@127.0.0.1:8000/v1")
    assert proc.returncode == 2 and "ftp://[redacted]@127.0.0.1:8000/v1" in proc.stderr, proc.stderr
    assert PASSWORD not in proc.stderr and PASSWORD not in proc.stdout


@pytest.mark.parametrize(
    "url,shown",
    [
        ("http://u:p@h:1/a@b", "http://[redacted]@h:1/a@b"),  # an @ in the path is no credential
        ("http://a@b@h/v1", "http://[redacted]@h/v1"),
        ("u:p@h:8000", "[redacted]@h:8000"),  # no scheme
        ("http://h/v1?x=a@b", "http://h/v1?x=a@b"),
        ("https://api.example.com/v1", "https://api.example.com/v1"),
    ],
)
def test_shown_url_redacts_the_credentials_and_nothing_else(url, shown):
    assert shown_url(url) == shown
