"""Knowledge distillation in the SFT step: divergences between teacher and student
next-token distributions (`divergences`), teacher log-probs computed in row chunks or as
top-K plus a tail bucket (`teacher`), and the loss term the SFT step adds (`loss`)."""
