"""The benchmarks' shared workload: chat prompts rendered with the model's template."""

QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about autumn leaves.",
    "What are the three states of matter?",
    "Give me a tip for learning a new language.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet.",
    "What is a prime number? Give two examples.",
    "How do vaccines train the immune system?",
    "Describe a cat to someone who has never seen one.",
    "What does a data engineer do?",
    "List three uses of a paperclip.",
    "What is the difference between weather and climate?",
    "Translate 'good morning' into Spanish and French.",
    "Why do we have seasons on Earth?",
    "Suggest a name for a coffee shop run by robots.",
]


def chat_prompt_ids(tokenizer, count: int) -> list[list[int]]:
    """`count` chat prompts (cycling through QUESTIONS, numbered so they differ) as token ids."""
    prompts = []
    for i in range(count):
        question = f"{QUESTIONS[i % len(QUESTIONS)]} (Question {i + 1}.)"
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        prompts.append(tokenizer(text, add_special_tokens=False).input_ids)
    return prompts
