"""Tests of recipes."""
