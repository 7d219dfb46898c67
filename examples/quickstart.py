import torch
import torch.nn.functional as F

import lossweight

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(100, 32), torch.nn.Linear(32, 100))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
acc = lossweight.Accumulator(weight_by="tokens", loss_reduction="sum")

for step in range(3):
    # One optimizer step = 4 microbatches of very different numbers of real tokens.
    microbatches = []
    for length in torch.randint(1, 64, (4,)).tolist():
        tokens = torch.randint(0, 100, (2, 64))
        labels = tokens.clone()
        labels[:, length:] = -100  # padding: no loss there
        microbatches.append((tokens, labels))

    acc.begin(num_tokens=[(labels != -100).sum() for _, labels in microbatches])
    for tokens, labels in microbatches:
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        acc.scale_loss(loss).backward()
    result = acc.end()
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {step}: loss {result.loss.item():.4f} over {result.num_tokens.item()} tokens")
