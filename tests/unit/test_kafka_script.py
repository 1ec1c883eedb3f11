"""deploy/kafka/kafka.sh (services.local_kafka): storage formats never roll the 1-in-64 die
of an id that looks like an option."""

from __future__ import annotations

import base64
import contextlib
import io
import re
import subprocess
from pathlib import Path

from services import local_kafka
from services.local_kafka.options import Options
from services.local_kafka.props import format_args

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "kafka" / "kafka.sh"


def _cluster_id_in_process() -> str:
    """``kafka.sh cluster-id`` as the launcher runs it, in this process (what services.common.broker does)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert local_kafka.run(["cluster-id"], {}) == 0
    return out.getvalue().strip()


def test_200_cluster_ids_are_valid_and_never_start_with_a_dash() -> None:
    """Without the redraw, 200 ids would hold a leading '-' with probability 1 - (63/64)^200 ≈ 96%.

    The first id comes through the script itself; the other 199 from the same command in-process
    (199 more bash and interpreter start-ups would prove nothing more)."""
    ids = [subprocess.run(["bash", str(SCRIPT), "cluster-id"], check=True, capture_output=True, text=True)
           .stdout.strip()]
    ids += [_cluster_id_in_process() for _ in range(199)]
    assert len(set(ids)) == 200
    for cluster_id in ids:
        assert re.fullmatch(r"[A-Za-z0-9_-]{22}", cluster_id), cluster_id
        assert not cluster_id.startswith("-"), cluster_id
        assert len(base64.urlsafe_b64decode(cluster_id + "==")) == 16


def test_format_passes_the_id_in_a_form_no_id_can_break(tmp_path: Path) -> None:
    """`--cluster-id=ID` keeps even an id starting with '-' one argument (a second guard)."""
    opts = Options.from_env({"KAFKA_RUN_DIR": str(tmp_path)})
    for static_quorum in (False, True):
        args = format_args(opts, tmp_path / "server.properties", "-starts-with-a-dash", static_quorum=static_quorum)
        assert "--cluster-id=-starts-with-a-dash" in args
        assert "--cluster-id" not in args  # never the two-argument form
