"""bench/service/step_script_cost.py: its variants are the step script with one part changed, and its split."""

from __future__ import annotations

import pytest

from bench.service import step_script_cost
from worker.step_script import LUA


def test_each_variant_changes_the_script_in_one_place():
    variants = step_script_cost.variants()
    assert variants["script"] == LUA
    assert (
        "'SET', applied_key, step, 'GET'" in variants["set-get"]
        and "redis.call('GET', applied_key)" not in variants["set-get"]
    )
    unchecked = variants["no-ownership-check"]
    assert "local who = me" in unchecked and "local who = owner(" not in unchecked


def test_split_fits_a_cost_per_call_and_per_record():
    assert step_script_cost.split({1: 31.0, 8: 80.0, 32: 248.0}) == pytest.approx((24.0, 7.0))
