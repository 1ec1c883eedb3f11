"""The pure fold of ``response-index`` records (issue 27): which location and checkpoint a start trusts."""

from __future__ import annotations

from schemas import ResponseIndexed, StoreCheckpointed, decode_store_index, encode
from services.inference.store_index import LoadedIndex, checkpoint_key


def test_the_higher_offset_of_a_key_wins_whatever_order_two_followers_wrote_it() -> None:
    loaded = LoadedIndex()
    loaded.apply("d:s|h", ResponseIndexed(partition=1, offset=9), {0, 1})
    loaded.apply("d:s|h", ResponseIndexed(partition=1, offset=4), {0, 1})  # a lagging worker's older record
    assert loaded.entries == {"d:s|h": (1, 9)}


def test_a_tombstone_deletes_and_foreign_partitions_are_ignored() -> None:
    loaded = LoadedIndex()
    loaded.apply("a|h", ResponseIndexed(partition=0, offset=1), {0})
    loaded.apply("b|h", ResponseIndexed(partition=5, offset=1), {0})  # the store has no partition 5 (any more)
    loaded.apply("#5", StoreCheckpointed(partition=5, next_offset=3), {0})
    loaded.apply("#0", StoreCheckpointed(partition=0, next_offset=2), {0})
    loaded.apply("a|h", None, {0})
    assert loaded.entries == {} and loaded.checkpoints == {0: 2} and loaded.records == 5


def test_a_checkpoint_key_cannot_be_a_store_key() -> None:
    # A store key is "<dataset>:<sample_id>|<hash>": it always holds "|".
    assert "|" not in checkpoint_key(12) and checkpoint_key(12) == "#12"


def test_old_index_records_without_a_version_still_decode() -> None:
    assert decode_store_index(b'{"kind":"indexed","partition":0,"offset":7}') == ResponseIndexed(partition=0, offset=7)
    assert decode_store_index(encode(StoreCheckpointed(partition=3, next_offset=0))).next_offset == 0
