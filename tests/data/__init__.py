"""Tests of data."""
