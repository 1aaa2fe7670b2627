"""What a listener hears: the speech check (an answer transcribed by a recogniser and scored
against the text it was asked to say)."""
