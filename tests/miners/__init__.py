"""Tests of miners."""
