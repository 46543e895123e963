"""The REST API of SPEC section 5: thin views that translate HTTP into engine calls."""
