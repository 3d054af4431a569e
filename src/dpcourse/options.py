"""``--help`` that shows each option's default once: a lab's ``formatter_class``.

argparse's ArgumentDefaultsHelpFormatter adds "(default: …)" only to options with a help text,
and also to those whose text already says what happens by default ("(default: None)" after
"(default: each epoch)"). This one adds it to every option that has a real default, once.
"""
import argparse


class Defaults(argparse.HelpFormatter):
    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)".lstrip()
