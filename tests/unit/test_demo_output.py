"""What `walbus demo` prints of its own local stack: never the database password."""

from __future__ import annotations

from walbus.app.demo import endpoints_text


def test_the_demo_prints_its_stack_without_the_password() -> None:
    text = endpoints_text("postgresql://postgres:c510e97b5873c234@127.0.0.1:13077/postgres", "127.0.0.1:17391")
    assert "c510e97b5873c234" not in text
    assert "postgresql://postgres:***@127.0.0.1:13077/postgres" in text
    assert "127.0.0.1:17391" in text
