"""The ``/work`` WebSocket (SPEC section 6): workers get items pushed under capacity."""
