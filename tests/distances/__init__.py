"""Tests of distances."""
