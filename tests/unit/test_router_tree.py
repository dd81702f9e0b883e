"""The router's prefix tree: insert, longest-prefix match, and least-recently-used eviction."""

from __future__ import annotations

from framework.router.prefix_tree import PrefixTree


def test_match_counts_the_longest_shared_prefix() -> None:
    tree = PrefixTree(max_chars=1000)
    tree.insert("the quick brown fox")
    tree.insert("the quick red fox")
    assert tree.match("the quick brown fox jumps") == len("the quick brown fox")
    assert tree.match("the quick red hen") == len("the quick red ")
    assert tree.match("the slow") == len("the ")
    assert tree.match("a fox") == 0
    assert tree.match("") == 0


def test_shared_prefixes_are_stored_once() -> None:
    tree = PrefixTree(max_chars=1000)
    tree.insert("abcdef")
    tree.insert("abcxyz")
    tree.insert("abc")  # ends inside what is held: nothing new
    assert tree.size == len("abc") + len("def") + len("xyz")
    assert tree.match("abc") == 3


def test_eviction_drops_the_least_recently_used_leaf_first() -> None:
    tree = PrefixTree(max_chars=12)
    tree.insert("root-aaaa")  # 9 chars
    tree.insert("root-bbbb")  # splits: "root-" + "aaaa" + "bbbb" = 13 > 12: "aaaa" goes
    assert tree.size <= 12
    assert tree.match("root-aaaa") == len("root-")
    assert tree.match("root-bbbb") == len("root-bbbb")


def test_a_match_makes_a_leaf_recent() -> None:
    tree = PrefixTree(max_chars=14)
    tree.insert("xx-aaaa")
    tree.insert("xx-bbbb")  # "xx-" + "aaaa" + "bbbb" = 11
    assert tree.match("xx-aaaa") == 7  # "aaaa" is now more recent than "bbbb"
    tree.insert("xx-cccc")  # 15 > 14: the oldest leaf, "bbbb", goes
    assert tree.match("xx-aaaa") == 7
    assert tree.match("xx-bbbb") == 3
    assert tree.match("xx-cccc") == 7


def test_eviction_empties_whole_branches_past_the_bound() -> None:
    tree = PrefixTree(max_chars=10)
    tree.insert("a" * 8)
    tree.insert("b" * 30)  # larger than the bound: everything goes, itself too
    assert tree.size <= 10
    assert tree.match("a" * 8) == 0
