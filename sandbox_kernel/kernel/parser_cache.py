"""The command-line parser a fork server builds once, for each of its kernels to take.

traitlets builds the parser on every start, one argument per configurable trait of every
class, after listing the classes that have such traits: ~2.5 ms of a fork-served kernel's
start, the same every time. A fork server calls prebuild_parser() before it forks; each kernel
takes its own copy-on-write copy. The hooks are traitlets' own (`_classes_with_config_traits`,
`_create_loader`), extended and calling super; tests/test_prebuilt_parser.py guards them.
"""

from __future__ import annotations

from typing import Any, ClassVar

from traitlets.config.loader import KVArgParseConfigLoader

_Prebuilt = tuple[tuple[Any, ...], dict[str, Any]]


class PrebuiltParser:
    """Application mixin (before the Application in the bases): parse with a prebuilt parser."""

    # Kept on the mixin, not on each subclass: one parser per application class (the class
    # itself is among the configurable classes it lists), taken once in each process.
    _built: ClassVar[dict[type, _Prebuilt]] = {}

    @classmethod
    def prebuild_parser(cls) -> None:
        """Build the parser (and the class list it needs) once, with a throwaway application.

        Never a singleton: the server's own instance must not become the kernels' application.
        """
        app: Any = cls()
        flags, aliases = app.flatten_flags()
        classes = list(app._classes_with_config_traits())
        loader = KVArgParseConfigLoader([], aliases, flags, classes=classes)
        loader._create_parser()
        built = {"parser": loader.parser, "argparse_traits": loader.argparse_traits}
        PrebuiltParser._built[cls] = ((aliases, flags, classes), built)

    @staticmethod
    def discard_prebuilt() -> None:
        """Forget the parsers built and not taken yet (tests; a server that changes options)."""
        PrebuiltParser._built.clear()

    @staticmethod
    def prebuilt_pending() -> bool:
        """Whether a prebuilt parser waits to be taken."""
        return bool(PrebuiltParser._built)

    def _classes_with_config_traits(self, classes: Any = None) -> Any:
        """traitlets' list of configurable classes, or the prebuilt parser's (the same list)."""
        prebuilt = PrebuiltParser._built.get(type(self))
        if classes is None and prebuilt is not None:
            return iter(prebuilt[0][2])
        return super()._classes_with_config_traits(classes)  # type: ignore[misc]

    def _create_loader(self, argv: Any, aliases: Any, flags: Any,
                       classes: Any) -> KVArgParseConfigLoader:
        """traitlets' loader, given the prebuilt parser when it was built for these options."""
        loader: KVArgParseConfigLoader = super()._create_loader(  # type: ignore[misc]
            argv, aliases, flags, classes)
        # Taken once (every class's: a process parses one command line): parsing leaves state
        # in the parser (the flags it saw).
        prebuilt = PrebuiltParser._built.get(type(self))
        PrebuiltParser._built.clear()
        if prebuilt is not None and prebuilt[0] == (aliases, flags, classes):
            loader._create_parser = lambda: vars(loader).update(prebuilt[1])  # type: ignore[method-assign]
        return loader
