"""Who may use an instance: tokens, UI users, session cookies, and the gate that checks them."""
