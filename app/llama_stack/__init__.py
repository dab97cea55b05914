"""The Llama Stack API family (modern and legacy routes): routes, schemas, converter, tools."""
