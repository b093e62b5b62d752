"""Names are types (wire/names.py): a token or a dotted key, checked with an error that names the field.

Properties (hypothesis): a value passes ``check_token`` exactly when it matches ``TOKEN_PATTERN`` (the
pattern msgspec checks), and then it is a NATS subject token and a KV key part (nats.py's own key regex,
the pool record key); the same for ``check_key`` and dotted keys. A refused value raises ``BadName``, a
``ValueError`` whose one-line message starts with the field and stays short whatever the value's length.
Every name in the recaptured state (tests/fixtures/prev_main) and in the shipped configs still passes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.js.kv import VALID_KEY_RE

from wire import PoolKey
from wire.names import (
    JOB_ID_MAX,
    KEY_MAX,
    KEY_PATTERN,
    TOKEN_MAX,
    TOKEN_PATTERN,
    BadName,
    check_job_id,
    check_key,
    check_pool_key,
    check_token,
)
from wire.subjects import subject_logs, subject_price

REPO = Path(__file__).resolve().parents[2]
HOSTILE = ["", " ", "gpu evil", "gpu..x", ".gpu", "gpu.", "a*b", "a>b", "a\tb", "a\nb", "a\x00b", "é", "a/b",
           "x" * 5000, "gpu\n", "\u2028"]
names = st.one_of(st.text(max_size=140), st.from_regex(TOKEN_PATTERN), st.from_regex(KEY_PATTERN),
                  st.sampled_from(HOSTILE))


@given(names)
def test_token_is_its_pattern_and_a_subject_token_and_a_kv_key_part(value: str) -> None:
    try:
        ok = check_token("job id", value) == value
    except BadName as e:
        ok = False
        _assert_clear(e, "job id", value)
    assert ok == bool(re.search(TOKEN_PATTERN, value))
    if ok:
        assert subject_logs(value, value).count(".") == 3  # one token each
        assert VALID_KEY_RE.match(f"job.{value}") and VALID_KEY_RE.match(f"node.{value}")


@given(names)
def test_key_is_its_pattern_and_a_kv_key_part(value: str) -> None:
    try:
        ok = check_key("PriceTick.pool.instance_type", value) == value
    except BadName as e:
        ok = False
        _assert_clear(e, "PriceTick.pool.instance_type", value)
    assert ok == bool(re.search(KEY_PATTERN, value))
    if ok:
        pool = PoolKey(cloud="aws", region="us-east-1", zone="us-east-1a", instance_type=value, market="spot")
        record_key = "pool." + pool.name.replace("/", "_")
        assert VALID_KEY_RE.match(record_key) and "" not in record_key.split(".")
        assert len(value) <= KEY_MAX


def _assert_clear(e: BadName, field: str, value: object) -> None:
    text = str(e)
    assert isinstance(e, ValueError) and e.field == field and text.startswith(f"{field}: ")
    assert "\n" not in text and len(text) < 200, text
    assert e.problem in text


@pytest.mark.parametrize("value,problem", [
    ("", "must not be empty"), ("gpu evil", "white space"), ("a.b", "dot"), ("a*", "wildcard"),
    ("x" * (TOKEN_MAX + 1), "longer than 128"), ("a/b", "'/'"), (7, "must be a string")])
def test_token_problems_are_named(value: object, problem: str) -> None:
    with pytest.raises(BadName, match=re.escape(problem)):
        check_token("node id", value)


@pytest.mark.parametrize("value,problem", [
    ("gpu..x", "empty part"), (".x", "empty part"), ("x.", "empty part"), ("gpu evil", "white space"),
    ("x" * (KEY_MAX + 1), "longer than 128"), ("a>b", "wildcard"), ("p4d/24", "'/'")])
def test_key_problems_are_named(value: str, problem: str) -> None:
    with pytest.raises(BadName, match=re.escape(problem)):
        check_key("instance type", value)


def test_job_ids_leave_room_for_their_node_ids() -> None:
    jid = "j" * JOB_ID_MAX
    assert check_job_id(jid) == jid
    check_token("node id", f"{jid}-n{10**9}")
    with pytest.raises(BadName, match="job id: longer than 100"):
        check_job_id(jid + "j")


def test_pool_keys_name_the_part() -> None:
    good = PoolKey(cloud="aws", region="us-east-1", zone="us-east-1a", instance_type="p4d.24xlarge", market="spot")
    assert check_pool_key("pool", good) is good
    with pytest.raises(BadName, match=r"^tick\.pool\.zone: contains a dot"):
        check_pool_key("tick.pool", PoolKey(cloud="aws", region="r", zone="a.b", instance_type="x", market="spot"))
    with pytest.raises(BadName, match=r"^tick\.pool\.instance_type: has an empty part"):
        check_pool_key("tick.pool", PoolKey(cloud="aws", region="r", zone="z", instance_type="gpu..x", market="spot"))


def test_every_name_in_the_recaptured_state_still_passes() -> None:
    fix = REPO / "tests" / "fixtures" / "prev_main" / "state"
    records = {k: json.loads(v) for k, v in json.loads((fix / "kv_ORCH_STATE.json").read_text()).items()}
    seen = 0
    for key, rec in records.items():
        if key.startswith("job."):
            check_job_id(rec["job_id"])
            sid = rec["spec"].get("sweep_id")
            if sid is not None:
                check_token("sweep id", sid)
            for it in rec["spec"].get("instance_types", []):
                check_key("instance type", it)
        elif key.startswith("node."):
            check_token("node id", rec["node_id"])
            check_pool_key("node.pool", PoolKey(**rec["pool"]))
        elif key.startswith("pool."):
            check_pool_key("pool", PoolKey(**rec["pool"]))
        seen += 1
    assert seen == len(records) > 10
    known = records["meta"]["config"]["known_instance_types"]
    assert known == ["fake/*"]  # the previous version's wildcard entry: it loads, and matches nothing now
    assert check_token("cloud", known[0].partition("/")[0]) == "fake"


def test_subject_price_refuses_what_check_token_refuses() -> None:
    for bad in HOSTILE:
        if not re.search(TOKEN_PATTERN, bad):
            with pytest.raises(ValueError):
                subject_price(bad, "r1")


@given(names)
def test_the_yes_or_no_forms_agree_with_the_checks(value: str) -> None:
    from wire.names import BadName, is_key, is_token

    for check, yes in ((check_token, is_token), (check_key, is_key)):
        try:
            check("field", value)
            ok = True
        except BadName:
            ok = False
        assert yes(value) is ok, (check.__name__, value)
