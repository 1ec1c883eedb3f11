"""deploy/kafka/kafka.sh: storage formats never roll the 1-in-64 die of an id that looks like an option."""

from __future__ import annotations

import base64
import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "kafka" / "kafka.sh"


def test_200_cluster_ids_are_valid_and_never_start_with_a_dash() -> None:
    """Without the redraw, 200 ids would hold a leading '-' with probability 1 - (63/64)^200 ≈ 96%."""
    ids = [subprocess.run(["bash", str(SCRIPT), "cluster-id"], check=True, capture_output=True, text=True)
           .stdout.strip() for _ in range(200)]
    assert len(set(ids)) == 200
    for cluster_id in ids:
        assert re.fullmatch(r"[A-Za-z0-9_-]{22}", cluster_id), cluster_id
        assert not cluster_id.startswith("-"), cluster_id
        assert len(base64.urlsafe_b64decode(cluster_id + "==")) == 16


def test_format_passes_the_id_in_a_form_no_id_can_break() -> None:
    """`--cluster-id=ID` keeps even an id starting with '-' one argument (a second guard)."""
    text = SCRIPT.read_text(encoding="utf-8")
    assert '"--cluster-id=$cluster_id"' in text
    assert not re.search(r"--cluster-id \"\$", text)
