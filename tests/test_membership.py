"""Proxy membership: URL checks, the nodes file, and applying its changes."""

from __future__ import annotations

import json
import os

import pytest

from pdserve.proxy.membership import Membership, NodesFile, check_url, read_nodes_file

PD_ROLES = ("prefill", "decode")


@pytest.mark.parametrize("url, problem", [
    ("localhost:8000", "http(s)://host:port"),
    ("ftp://h:1", "http(s)://host:port"),
    ("http://h:1/v1", "no path"),
    ("http://h:99999", "port"),
    (42, "string"),
])
def test_bad_urls_are_named(url, problem):
    with pytest.raises(ValueError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        check_url(url)


def test_membership_roles_follow_the_mode():
    m = Membership("pull", PD_ROLES)
    m.add("http://127.0.0.1:1/", "prefill")
    m.add("http://127.0.0.1:2", "decode")
    assert [n.url for n in m.prefillers] == ["http://127.0.0.1:1"]
    with pytest.raises(ValueError, match="role must be one of"):
        m.add("http://127.0.0.1:3", "both")
    with pytest.raises(ValueError, match="already a node"):
        m.add("http://127.0.0.1:2", "decode")
    with pytest.raises(LookupError):
        m.remove("http://127.0.0.1:9")
    assert m.remove("http://127.0.0.1:2/").role == "decode" and m.decoders == []
    assert Membership("colocated", ("both",)).add("http://127.0.0.1:4", "both").role == "both"


@pytest.mark.parametrize("content, problem", [
    ("{", "not JSON"),
    ("[]", "JSON object"),
    ('{"node": ["http://h:1"]}', "key 'node'"),
    ('{"prefill": "http://h:1"}', "list of URLs"),
    ('{"decode": ["h:1"]}', "http"),
])
def test_bad_nodes_files_are_named(tmp_path, content, problem):
    path = tmp_path / "nodes.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=problem):
        read_nodes_file(str(path), "pull", PD_ROLES)
    with pytest.raises(ValueError, match="No such file"):
        read_nodes_file(str(tmp_path / "missing.json"), "pull", PD_ROLES)


def test_nodes_file_changes_add_and_remove_only_what_it_listed(tmp_path):
    path = tmp_path / "nodes.json"
    path.write_text(json.dumps({"prefill": ["http://h:1"], "decode": ["http://h:2"]}))
    m = Membership("push", PD_ROLES)
    m.add("http://h:9", "decode")  # from a flag: the file never removes it
    watched = NodesFile(str(path))
    watched.load(m)
    assert {n.url for n in m.nodes()} == {"http://h:1", "http://h:2", "http://h:9"}
    path.write_text(json.dumps({"prefill": ["http://h:1", "http://h:3"], "decode": []}))
    os.utime(path, ns=(0, 1))  # a different mtime even within the clock's resolution
    watched.poll(m)
    assert {(n.role, n.url) for n in m.nodes()} == {("prefill", "http://h:1"), ("prefill", "http://h:3"),
                                                   ("decode", "http://h:9")}
    path.write_text("{broken")
    os.utime(path, ns=(0, 2))
    watched.poll(m)  # logged, membership unchanged
    assert len(m.nodes()) == 3
