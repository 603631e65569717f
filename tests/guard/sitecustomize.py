# Loaded by every Python process of the test session (tests/conftest.py puts this folder on
# PYTHONPATH): the connect guard (connect_guard.py).
import connect_guard

connect_guard.install()
