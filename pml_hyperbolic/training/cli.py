"""What a recipe script subclasses: :class:`RecipeCommandLine`, the torch-free command line of
:mod:`.command_line` plus the one step that joins a recipe with the runner.

A recipe script subclasses :class:`RecipeCommandLine` (its flags, presets and builders; the
builders import what they need inside their bodies). Creating an instance builds the runnable
class, ``(the recipe, its runtime_mixins(), runner.Recipe)``, and that is the moment the heavy
packages are imported::

    class HypViT(RecipeCommandLine):     # importing the script is light
        ...
    HypViT.main()                        # parse + check (light), then HypViT(args).run() (heavy)

Floors: this module is the top one; it imports :mod:`.command_line` (light) and, when an instance
is made, :mod:`.runner`, which itself imports only :mod:`.command_line` (never this module). Every
name of :mod:`.command_line` is available here too (its former home).

Design note: docs/design/recipe-defaults.md
"""
from __future__ import annotations

from .command_line import *  # noqa: F401,F403 (the names' former home: kept importable from here)
from .command_line import _HelpFormatter, _is_main_process, _run_file_names, _try_creating_a_folder  # noqa: F401
from .command_line import RecipeCommandLineBase


class RecipeCommandLine(RecipeCommandLineBase):
    """A recipe's flags, presets and start-up checks (no torch, see :class:`RecipeCommandLineBase`);
    instantiating a subclass returns an instance of its runnable class (see :meth:`runnable`).

    Design note: docs/design/recipe-defaults.md
    """

    def __new__(cls, *args, **kwargs):
        # The runnable class joins this one with the runner (torch, PML): imported here, not earlier.
        return super().__new__(cls.runnable())

    @classmethod
    def runtime_mixins(cls) -> tuple:
        """Heavy mixins placed between the recipe and ``runner.Recipe`` (imported inside, on use)."""
        return ()

    @classmethod
    def runnable(cls) -> type:
        """``cls`` itself when it already derives from ``runner.Recipe``, else (cached) the class
        ``(cls, *runtime_mixins(), runner.Recipe)``."""
        from .runner import Recipe

        if issubclass(cls, Recipe):
            return cls
        built = cls.__dict__.get("_runnable_class")
        if built is None:
            built = type(cls.__name__, (cls, *cls.runtime_mixins(), Recipe),
                         {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
            cls._runnable_class = built
        return built
