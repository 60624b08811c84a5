"""Tests of project."""
