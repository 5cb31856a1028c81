"""Command-line interface: ``mm-serve serve | generate | caption | bench | plan | profile``."""
