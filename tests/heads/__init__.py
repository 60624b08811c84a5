"""Tests of heads."""
