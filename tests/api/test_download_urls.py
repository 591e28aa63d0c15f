"""Signed download URLs (api/download_urls.py): only the signature made for the file and time is valid."""

from api import download_urls

KEY, RECORD, FILE = b"k" * 32, "record-1", "merged/model.safetensors"


def test_only_the_signature_of_this_file_before_it_expires_is_valid():
    good = download_urls.signature(KEY, RECORD, FILE, 2_000)
    assert download_urls.valid(KEY, RECORD, FILE, 2_000, good, now=1_000)
    assert not download_urls.valid(KEY, RECORD, FILE, 2_000, good, now=2_000)  # expired
    assert not download_urls.valid(KEY, RECORD, "other", 2_000, good, now=1_000)
    assert not download_urls.valid(KEY, RECORD, FILE, 3_000, good, now=1_000)  # a later expiry needs its own


def test_a_hostile_signature_is_refused_not_an_error():
    for given in ("é" * 43, "", "\x00", "a" * 10_000):
        assert not download_urls.valid(KEY, RECORD, FILE, 2_000, given, now=1_000)
