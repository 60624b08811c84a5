"""Tests of losses."""
