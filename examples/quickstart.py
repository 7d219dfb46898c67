import torch

import lossweight

model = torch.nn.Sequential(torch.nn.Embedding(100, 32), torch.nn.Linear(32, 100))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
acc = lossweight.Accumulator(weight_by="tokens", loss_reduction="sum")


def microbatch(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """2 rows of 64 positions, of which the first `length` are real tokens."""
    tokens = torch.randint(0, 100, (2, 64))
    return tokens, tokens.masked_fill(torch.arange(64) >= length, -100)


for step in range(3):
    microbatches = [microbatch(n) for n in (60, 3, 17, 1)]  # very uneven; the last has no target
    acc.begin(num_tokens=[lossweight.count_tokens(y, shift=True) for _, y in microbatches])
    for tokens, labels in microbatches:
        loss_sum, _ = lossweight.token_cross_entropy(model(tokens), labels, shift=True)
        acc.scale_loss(loss_sum).backward()
    result = acc.end()
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {step}: loss {result.loss.item():.4f} over {result.num_tokens.item()} tokens")
