"""FA4's disk cache of compiled kernels: on by default, off where the environment says so or
where FA4 could not create its default directory (no user name, no writable temp dir)."""

import getpass
import os

import pytest

from dataplane.attention import flash_attn_backend

ENABLED, DIR = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """Neither variable set, and both as they were after the test (setenv records them first:
    delenv alone records nothing for an unset variable)."""
    for name in (ENABLED, DIR):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def no_user_name():
    raise KeyError("getpwuid(): uid not found: 1000660000")


def test_on_by_default():
    flash_attn_backend._keep_fa4_kernels_on_disk()
    assert os.environ[ENABLED] == "1"


def test_the_environment_turns_it_off(monkeypatch):
    monkeypatch.setenv(ENABLED, "0")
    flash_attn_backend._keep_fa4_kernels_on_disk()
    assert os.environ[ENABLED] == "0"


def test_off_for_a_uid_without_a_name_unless_a_directory_is_named(monkeypatch, tmp_path):
    monkeypatch.setattr(getpass, "getuser", no_user_name)
    flash_attn_backend._keep_fa4_kernels_on_disk()
    assert ENABLED not in os.environ
    monkeypatch.setenv(DIR, str(tmp_path))
    flash_attn_backend._keep_fa4_kernels_on_disk()
    assert os.environ[ENABLED] == "1"


def test_off_without_a_writable_temp_dir(monkeypatch, tmp_path):
    monkeypatch.setattr(flash_attn_backend.tempfile, "gettempdir", lambda: str(tmp_path / "no"))
    flash_attn_backend._keep_fa4_kernels_on_disk()
    assert ENABLED not in os.environ
